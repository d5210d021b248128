"""Does a state pooled over the question being asked carry an edit's fact to its rewordings, and stay
apart after the edit's statement? (The premise of the issue's "address read over the current question's
span".)

The span is the text after the prompt's last sentence end (". ", "? ", "! " or a line break): the whole
request alone, the request after preceding text, the neighbour question after the edit's statement. Per
layer, the reading points of the MLP down-projection input: the prompt's last token (ALOE's address),
the mean of the span's unit token states, the mean of its raw states (then unit), the last two
side by side (a cosine that averages the span's and the last token's), and exponential running means of
the whole prompt's unit states (no span boundary to find: the simplest state a decoder can carry). Each edit's address is
its request's reading; every prompt of the tuning slice (:mod:`.scope_prompts`) is compared with every
address by cosine. Per reading point: the share of rewordings (and of in-context requests) whose nearest
address is their own, and the share that clear every prompt of the slice that does not ask the edit's
fact (its statement then another question, its subject with another relation, the neighbours, every other
edit's prompts): what a per-edit gate could open with nothing else open.

    python -m experiments.span_states --edits $DATA/counterfact/counterfact-val.json --start 1500 --n 100 \\
        --layers 2 4 8 14 22 --out FILE.json
"""

from __future__ import annotations

import json
import re
import sys

import torch
import torch.nn.functional as F

from aloe_build import load_edits
from aloe_build.forward import progress_bar
from aloe_build.models import load_model
from aloe_build.tokens import left_pad, pad_id
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reading import running_unit_sum

from .scope_prompts import auc, save_result, scope_prompts, slice_parser

#: where a sentence ends: the question's span starts after the last of these
SENTENCE_END = re.compile(r"[.?!]\s+|\n")
#: decays of the running (exponential) means of the whole prompt's unit states: no span to find
EMA_DECAYS = (0.5, 0.7, 0.85)
READINGS = ("last_token", "span_unit_mean", "span_raw_mean", "span_and_last", *(f"ema_{d}" for d in EMA_DECAYS))


def span_start_token(tokenizer, text: str) -> tuple[list[int], int]:
    """Prompt ids of ``text`` and the index of the first token of its last sentence."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    ends = [m.end() for m in SENTENCE_END.finditer(text.rstrip())]
    start_char = ends[-1] if ends else 0
    first = next((i for i, (a, b) in enumerate(offsets) if b > start_char and b > a), 0)
    return ids, first


@torch.no_grad()
def span_readings(model, tok, texts, layers, batch: int = 16) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer and reading point, the unit reading of every text, (n, d) float64."""
    box: dict[int, torch.Tensor] = {}
    hooks = [
        locate_down_proj(model, layer).module.register_forward_pre_hook(
            lambda m, a, layer=layer: box.__setitem__(layer, a[0].double())
        )
        for layer in layers
    ]
    encoded = [span_start_token(tok, t) for t in texts]
    out = {layer: {r: [] for r in READINGS} for layer in layers}
    bar = progress_bar(len(texts), "span states", True)
    try:
        for lo in range(0, len(texts), batch):
            chunk = encoded[lo : lo + batch]
            ids, mask, pos = left_pad([s for s, _ in chunk], pad_id(tok), "cpu")
            width = ids.shape[1]
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
            for layer in layers:
                for b, (seq, first) in enumerate(chunk):
                    whole = box[layer][b, width - len(seq) :]
                    span = whole[first:]
                    out[layer]["last_token"].append(span[-1])
                    out[layer]["span_unit_mean"].append(F.normalize(span, dim=-1).mean(0))
                    out[layer]["span_raw_mean"].append(span.mean(0))
                    # both halves unit, so the cosine is the mean of the span's and the last token's
                    out[layer]["span_and_last"].append(
                        torch.cat([F.normalize(span.mean(0), dim=-1), F.normalize(span[-1], dim=-1)])
                    )
                    for decay in EMA_DECAYS:
                        out[layer][f"ema_{decay}"].append(running_unit_sum(whole[None], decay)[0, -1])
            bar.update(len(chunk))
    finally:
        bar.close()
        for h in hooks:
            h.remove()
    return {layer: {r: F.normalize(torch.stack(v), dim=-1) for r, v in d.items()} for layer, d in out.items()}


def asked_edit(rows, edits) -> list[int | None]:
    """Per row, the edit whose fact the prompt asks (its request, rewording, or request after any
    preceding text, another edit's statement included), else None. A distracted prompt asks the edit
    whose request it ends with (matched whole: a request may hold a sentence end, "Andrew F. Warga")."""
    asked = []
    for i, kind, text in rows:
        if kind in ("request", "rephrase", "in_context"):
            asked.append(i)
        elif kind == "distracted":
            ends = [j for j, e in enumerate(edits) if text.endswith(" " + e.prompt)]
            asked.append(max(ends, key=lambda j: len(edits[j].prompt)) if ends else None)
        else:
            asked.append(None)
    return asked


def score(rows, asked, request_rows, reading: torch.Tensor) -> dict[str, float | None]:
    """The retrieval and clearance shares of one reading point (see the module docstring)."""
    sims = reading @ reading[request_rows].T  # (prompts, edits)
    n_edits = len(request_rows)
    asked_t = torch.tensor([-1 if a is None else a for a in asked])
    not_asking = asked_t[:, None] != torch.arange(n_edits)[None]  # (prompts, edits)
    ceiling = torch.where(not_asking, sims, torch.full_like(sims, -2.0)).max(0).values  # per edit
    out: dict[str, float | None] = {}
    for kind in ("request", "rephrase", "in_context"):
        idx = [k for k, (_, kd, _) in enumerate(rows) if kd == kind]
        own = asked_t[idx]
        found = sims[idx].argmax(1) == own
        clear = sims[idx, own] > ceiling[own]
        out[f"{kind}/nearest_own"] = float(found.double().mean())
        out[f"{kind}/clears_all"] = float(clear.double().mean())
    after = [k for k, (i, kd, _) in enumerate(rows) if kd == "distracted" and asked[k] is not None]
    if after:
        own = asked_t[after]
        out["request_after_statement/clears_all"] = float((sims[after, own] > ceiling[own]).double().mean())
    pos = [float(sims[k, i]) for k, (i, kd, _) in enumerate(rows) if kd in ("rephrase", "in_context")]
    for kind in ("distracted", "same_subject", "neighbour"):
        neg = [float(sims[k, i]) for k, (i, kd, _) in enumerate(rows) if kd == kind and asked[k] is None]
        out[f"auc_positives_vs_own_{kind}"] = auc(pos, neg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = slice_parser(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 14, 22])
    args = ap.parse_args(argv)
    edits = load_edits(args.edits, skip_invalid=args.skip_invalid)[args.start : args.start + args.n]
    model, tok = load_model(args.model)
    rows = scope_prompts(edits)
    asked = asked_edit(rows, edits)
    request_rows = [k for k, (_, kind, _) in enumerate(rows) if kind == "request"]
    readings = span_readings(model, tok, [t for _, _, t in rows], args.layers)
    result: dict = {"edits": len(edits), "prompts": len(rows), "chance": 1 / len(edits)}
    for layer, by_reading in readings.items():
        for name, reading in by_reading.items():
            result[f"layer{layer}/{name}"] = score(rows, asked, request_rows, reading)
            print(f"layer {layer:2d} {name:15s}", json.dumps(result[f"layer{layer}/{name}"]), flush=True)
    save_result(result, "experiments.span_states", argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
