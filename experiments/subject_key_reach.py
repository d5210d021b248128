"""Does a key written at the edited subject's last token reach the question's last token at the edited
layer, strongly where the question is about that subject and weakly where the subject was only stated before
another question? (The premise of a two-layer, conjunctive address.)

Forward passes only, on a tuning slice (:mod:`.scope_prompts`). A fixed random unit direction ``k``, scaled
by the residual's norm there (``--scale``), is added to the residual after decoder layer ``L1`` at the last
token of every occurrence of the edit's subject (none in a neighbour prompt). The down-projection input at
layer ``--l2`` (ALOE's reading point), last token, is read with and without the key. Per ``(L1, scale)``:

* the relative change the key makes there, per prompt kind;
* a linear read of it: ``u``, the mean change of the unit states on the positives of the first half of the
  edits; on the second half, the AUC of ``u . h/|h|`` of the positives against the distracted prompts and
  against every prompt without the key, and the share of positives above every negative;
* how often the key alone changes the next token (it must change nothing where the gate stays shut).

    python -m experiments.subject_key_reach --edits $DATA/counterfact/counterfact-val.json --start 1500 --n 100 \\
        --l1 2 4 8 12 16 --scale 0.5 1 2 --out FILE.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from aloe_build import load_edits
from aloe_build.models import load_model
from aloe_build.tokens import left_pad, pad_id
from aloe_kernels.hf import decoder_layers, locate_down_proj

from .scope_prompts import POSITIVE_KINDS, auc, scope_prompts, slice_parser, subject_token_positions


@torch.no_grad()
def read_states(model, tok, seqs, key_pos, l1: int, l2: int, key: torch.Tensor, scale: float, batch: int = 16):
    """The down-projection input at layer ``l2`` (last token) and the argmax next token, per sequence, with
    ``scale`` times the residual's norm of ``key`` added after layer ``l1`` at each sequence's ``key_pos``."""
    _, layers = decoder_layers(model)
    state: dict = {}

    def inject(_m, _a, out):
        x = out[0] if isinstance(out, tuple) else out
        for b, positions in enumerate(state["pos"]):
            for p in positions:
                x[b, p] += scale * x[b, p].norm() * key
        return out

    def grab(_m, args):
        state["h"] = args[0][:, -1].float().clone()

    hooks = [locate_down_proj(model, l2).module.register_forward_pre_hook(grab)]
    if scale:
        hooks.append(layers[l1].register_forward_hook(inject))
    hs, nxt = [], []
    try:
        for lo in range(0, len(seqs), batch):
            chunk = seqs[lo : lo + batch]
            ids, mask, pos = left_pad(chunk, pad_id(tok), "cpu")
            width = ids.shape[1]
            state["pos"] = [[width - len(s) + p for p in key_pos[lo + b]] for b, s in enumerate(chunk)]
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1).logits
            hs.append(state["h"])
            nxt.append(logits[:, -1].argmax(-1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(hs), torch.cat(nxt)


def main(argv=None) -> None:
    ap = slice_parser(__doc__)
    ap.add_argument("--l1", type=int, nargs="+", default=[4, 8, 12], help="layers after which the key is written")
    ap.add_argument("--scale", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="key norms, in residual norms")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model("smollm2")
    edits = load_edits(a.edits, skip_invalid=a.skip_invalid)[a.start : a.start + a.n]
    rows = scope_prompts(edits)
    seqs, key_pos = [], []
    for i, kind, text in rows:
        ids, positions = subject_token_positions(tok, text, edits[i].subject)
        seqs.append(ids)
        key_pos.append([] if kind == "neighbour" else positions)
    kinds = sorted({k for _, k, _ in rows})
    found = {k: sum(bool(p) for (_, kk, _), p in zip(rows, key_pos) if kk == k) for k in kinds}
    key = F.normalize(torch.randn(model.config.hidden_size), dim=0)
    clean_h, clean_next = read_states(model, tok, seqs, key_pos, 0, a.l2, key, 0.0)
    half = len(edits) // 2
    train = [j for j, (i, k, _) in enumerate(rows) if i < half and k in POSITIVE_KINDS]
    test = [j for j, (i, _, _) in enumerate(rows) if i >= half]
    result = {"edits": a.edits, "start": a.start, "n": len(edits), "l2": a.l2, "subject_found": found, "configs": []}
    for l1 in a.l1:
        for s in a.scale:
            h, nxt = read_states(model, tok, seqs, key_pos, l1, a.l2, key, s)
            unit, clean_unit = F.normalize(h, dim=-1), F.normalize(clean_h, dim=-1)
            u = F.normalize((unit - clean_unit)[train].mean(0), dim=0)
            score, keyless = unit @ u, [float(clean_unit[j] @ u) for j in test]
            by: dict[str, list[float]] = {}
            for j in test:
                by.setdefault(rows[j][1], []).append(float(score[j]))
            negatives = by.get("distracted", []) + by.get("neighbour", []) + keyless
            rel = (h - clean_h).norm(dim=-1) / clean_h.norm(dim=-1)

            def per_kind(values):
                return {k: float(values[[j for j in range(len(rows)) if rows[j][1] == k]].float().mean()) for k in kinds}

            cfg = {
                "l1": l1,
                "scale": s,
                "relative_change_at_l2": per_kind(rel),
                "auc_vs_distracted": {k: auc(by.get(k, []), by.get("distracted", [])) for k in POSITIVE_KINDS},
                "auc_vs_keyless": {k: auc(by.get(k, []), keyless) for k in POSITIVE_KINDS},
                "recall_above_every_negative": {
                    k: sum(x > max(negatives) for x in by.get(k, [])) / max(1, len(by.get(k, [])))
                    for k in (*POSITIVE_KINDS, "same_subject")
                },
                "next_token_changed_by_key": per_kind(nxt != clean_next),
            }
            result["configs"].append(cfg)
            print(json.dumps(cfg), file=sys.stderr, flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
