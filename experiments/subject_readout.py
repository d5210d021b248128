"""Does the question's last token carry its subject, linearly, at the edited layer? (The premise of one
address vector at ALOE's reading point that follows the subject of the question being asked.)

A ridge map from the last-token down-projection input at layer ``--l2`` (ALOE's reading point) to the
subject's last-token down-projection input at layer ``--ls`` (where rewordings of one fact agree) is fitted on
the construction corpus (CounterFact train records and their first rewordings; no stream record). On a tuning
slice (:mod:`.scope_prompts`) each edit's key is its request's subject state; every prompt's last-token state
is mapped and compared (cosine) with every key. Per prompt kind: the share whose nearest key is the edit's own
(for ``distracted`` prompts: the stated edit's, which an address must not follow), the AUC of the own key's
cosine against the distracted prompts and against the neighbours, and the share above every one of them. The
raw last-token state against each request's (no map) is the control.

    python -m experiments.subject_readout --edits $DATA/counterfact/counterfact-val.json --start 1500 --n 100 \\
        --corpus-n 4000 --ridge 1e-3 1e-2 1e-1 --out FILE.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from aloe_build import load_edits
from aloe_build.corpus import default_corpus_path
from aloe_build.forward import progress_bar
from aloe_build.models import load_model
from aloe_build.tokens import left_pad, pad_id
from aloe_kernels.hf import locate_down_proj

from .scope_prompts import auc, scope_prompts, slice_parser, subject_token_positions


@torch.no_grad()
def read_states(model, tok, seqs, subject_pos, l2: int, ls: int, batch: int = 16):
    """Per sequence: the down-projection input of layer ``l2`` at the last token, and that of layer ``ls``
    at ``subject_pos`` (NaN where None)."""
    box: dict = {}
    hooks = [
        locate_down_proj(model, l2).module.register_forward_pre_hook(
            lambda m, a: box.__setitem__("last", a[0][:, -1].float().clone())
        ),
        locate_down_proj(model, ls).module.register_forward_pre_hook(lambda m, a: box.__setitem__("all", a[0].float())),
    ]
    last, subject = [], []
    bar = progress_bar(len(seqs), "states", True)
    try:
        for lo in range(0, len(seqs), batch):
            chunk = seqs[lo : lo + batch]
            ids, mask, pos = left_pad(chunk, pad_id(tok), "cpu")
            width = ids.shape[1]
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
            last.append(box["last"])
            nan = torch.full_like(box["all"][0, 0], float("nan"))
            subject.append(
                torch.stack(
                    [
                        box["all"][b, width - len(s) + subject_pos[lo + b]] if subject_pos[lo + b] is not None else nan
                        for b, s in enumerate(chunk)
                    ]
                )
            )
            bar.update(len(chunk))
    finally:
        bar.close()
        for h in hooks:
            h.remove()
    return torch.cat(last), torch.cat(subject)


def scores_by_kind(sim: torch.Tensor, rows) -> dict[str, dict[str, float | None]]:
    """``sim`` (prompts, edits): cosine of each prompt with each key; the figures of the module docstring."""
    owner = torch.tensor([r[0] for r in rows])
    own = sim[torch.arange(len(rows)), owner]
    nearest_own = sim.argmax(1) == owner
    by: dict[str, list[int]] = {}
    for j, r in enumerate(rows):
        by.setdefault(r[1], []).append(j)
    distracted, neighbours = own[by["distracted"]].tolist(), own[by["neighbour"]].tolist()
    top = max(distracted + neighbours)
    return {
        kind: {
            "nearest_key_is_own": float(nearest_own[js].float().mean()),
            "auc_vs_distracted": auc(own[js].tolist(), distracted),
            "auc_vs_neighbours": auc(own[js].tolist(), neighbours),
            "above_every_distracted_and_neighbour": float((own[js] > top).float().mean()),
        }
        for kind, js in by.items()
    }


def main(argv=None) -> None:
    ap = slice_parser(__doc__)
    ap.add_argument("--ls", type=int, default=8, help="layer of the subject-token states")
    ap.add_argument("--corpus-n", type=int, default=4000, help="construction-corpus records to fit on")
    ap.add_argument("--ridge", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1], help="ridge penalties to try")
    a = ap.parse_args(argv)
    model, tok = load_model("smollm2")
    corpus = load_edits(default_corpus_path())[: a.corpus_n]
    texts = [(r.prompt, r.subject) for r in corpus] + [(t, r.subject) for r in corpus for t in r.rephrases[:1]]
    enc = [subject_token_positions(tok, t, s) for t, s in texts]
    keep = [i for i, (_, p) in enumerate(enc) if p]
    X, Y = read_states(model, tok, [enc[i][0] for i in keep], [max(enc[i][1]) for i in keep], a.l2, a.ls)
    X, Y = F.normalize(X, dim=-1), F.normalize(Y, dim=-1)
    mean_x = X.mean(0)
    Xc = X - mean_x

    edits = load_edits(a.edits, skip_invalid=a.skip_invalid)[a.start : a.start + a.n]
    rows = scope_prompts(edits)
    tenc = [subject_token_positions(tok, text, edits[i].subject) for i, _, text in rows]
    H, S = read_states(model, tok, [t[0] for t in tenc], [max(t[1]) if t[1] else None for t in tenc], a.l2, a.ls)
    H = F.normalize(H, dim=-1)
    requests = [j for j, r in enumerate(rows) if r[1] == "request"]
    keys = F.normalize(S[requests], dim=-1)
    result = {"edits": a.edits, "start": a.start, "n": len(edits), "l2": a.l2, "ls": a.ls, "corpus_pairs": len(keep)}
    result["raw_last_token"] = scores_by_kind(H @ H[requests].T, rows)
    result["ridge"] = {}
    for lam in a.ridge:
        W = torch.linalg.solve(Xc.T @ Xc + lam * len(Xc) * torch.eye(Xc.shape[1]), Xc.T @ Y)
        fit = float((F.normalize(Xc @ W, dim=-1) * Y).sum(-1).mean())
        pred = F.normalize((H - mean_x) @ W, dim=-1)
        result["ridge"][str(lam)] = {"train_cosine": fit, **scores_by_kind(pred @ keys.T, rows)}
        print(json.dumps({"ridge": lam, **result["ridge"][str(lam)]}), file=sys.stderr, flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
