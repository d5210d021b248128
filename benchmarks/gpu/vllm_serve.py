"""The edited model served by vLLM on a GPU: CUDA graphs, bf16, TP = 1 and 2.

For a machine with CUDA and vLLM (the GPU image this project is lent has no vLLM, so this script
has not run yet). For each tensor-parallel size it:

1. exports the operator with ``--max-edits`` slots (``aloe_vllm.export.export_vllm``);
2. serves it with ``vllm.LLM`` in bf16 with CUDA graphs (no ``enforce_eager``), and the unedited
   base the same way;
3. checks greedy tokens on the operator's requests and on ``--unrelated`` prompts against the
   transformers model in bf16 on the GPU, patched with ``apply_aloe`` (and the unedited pair, which
   bounds what the two implementations' bf16 arithmetic alone changes);
4. times decode (``--batch`` prompts, ``--max-tokens`` tokens each, ``ignore_eos``) with and without
   the operator;
5. swaps to ``--swap-operator`` (if given) and back, checks the tokens after each swap against the
   patched transformers model, and that the ALOE parameters kept their storage (CUDA graphs read it).

    python -m benchmarks.gpu.vllm_serve --model /models/Llama-3-8B --operator runs/op \\
        --swap-operator runs/op-v2 --tp 1 2 --out benchmarks/results/gpu/<device>/vllm_serve
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

UNRELATED = [
    "The largest planet in the solar system is",
    "The chemical symbol for gold is",
    "Water boils at a temperature of",
    "The author of Pride and Prejudice is",
]


def _storage(worker) -> dict[str, int]:
    """On a worker: the ALOE parameters' ``data_ptr`` (a swap must copy in place)."""
    from aloe_vllm.format import PARAM_NAMES

    layer = worker._aloe_layer()
    return {} if layer is None else {name: getattr(layer, name).data_ptr() for name in PARAM_NAMES}


def hf_tokens(model_dir: str, operator: str | None, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the transformers model in bf16 on the GPU, patched with ``operator`` if given."""
    from aloe_build import models
    from aloe_kernels import AloeOperator, apply_aloe

    model, tok = models.load_model(model_dir, device="cuda", dtype=torch.bfloat16)
    if operator:
        apply_aloe(model, AloeOperator.load(operator))
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids.to("cuda")
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _llm(model: str, tp: int, swaps: bool):
    from vllm import LLM

    from aloe_vllm.swap import EXTENSION

    return LLM(
        model=model,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        seed=0,
        enforce_eager=False,
        worker_extension_cls=EXTENSION if swaps else "",
    )


def _generate(llm, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def _decode_tokens_per_s(llm, prompts: list[str], max_tokens: int, rounds: int) -> float:
    _generate(llm, prompts, max_tokens, ignore_eos=True)  # warm-up
    times = [_generate(llm, prompts, max_tokens, ignore_eos=True)[1] for _ in range(rounds)]
    return len(prompts) * max_tokens / statistics.median(times)


def run_tp(args: argparse.Namespace, tp: int, prompts: list[str], hf: dict) -> dict:
    from vllm.distributed import cleanup_dist_env_and_memory

    from aloe_vllm.export import export_vllm
    from aloe_vllm.swap import swap_operator

    serve = export_vllm(args.model, args.operator, Path(args.work) / f"serve-tp{tp}", overwrite=True, capacity=args.max_edits)
    batch = (prompts * (args.batch // len(prompts) + 1))[: args.batch]
    out: dict = {"tp": tp}
    llm = _llm(args.model, tp, swaps=False)
    base, _ = _generate(llm, prompts, args.max_tokens)
    out["base_tokens_per_s"] = _decode_tokens_per_s(llm, batch, args.max_tokens, args.rounds)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    llm = _llm(str(serve), tp, swaps=True)
    edited, _ = _generate(llm, prompts, args.max_tokens)
    out["edited_tokens_per_s"] = _decode_tokens_per_s(llm, batch, args.max_tokens, args.rounds)
    out["decode_ratio"] = out["edited_tokens_per_s"] / out["base_tokens_per_s"]
    out["agreement_edited_vs_hf"] = _agreement(edited, hf["edited"])
    out["agreement_base_vs_hf"] = _agreement(base, hf["base"])
    out["requests_changed_by_edit"] = 1 - _agreement(edited[: hf["n_requests"]], base[: hf["n_requests"]])
    out["unrelated_unchanged"] = _agreement(edited[hf["n_requests"] :], base[hf["n_requests"] :])
    if args.swap_operator:
        before = llm.collective_rpc(_storage)
        phases = {}
        for name, op in (("swapped", args.swap_operator), ("back", args.operator)):
            swap_operator(llm, op)
            phases[name] = _agreement(_generate(llm, prompts, args.max_tokens)[0], hf[name])
        out["swap_agreement_vs_hf"] = phases
        out["swap_storage_unchanged"] = llm.collective_rpc(_storage) == before
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return out


def main(argv: list[str] | None = None) -> int:
    from aloe_kernels import AloeOperator

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="base model directory")
    p.add_argument("--operator", required=True, help="ALOE operator artifact built for it")
    p.add_argument("--swap-operator", default=None, help="a second operator for the swap check")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-edits", type=int, default=None, help="slots to reserve (default: the larger operator's n)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=64, help="prompts per timed decode")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", default="/tmp/aloe-vllm-serve")
    p.add_argument("--out", required=True, help="write <out>.json and <out>.md")
    args = p.parse_args(argv)
    ops = [AloeOperator.load(x) for x in (args.operator, args.swap_operator) if x]
    args.max_edits = args.max_edits or max(op.n for op in ops)
    requests = [e["request"] for e in ops[0].edits if e.get("request")][:32]
    prompts = requests + UNRELATED
    hf = {
        "n_requests": len(requests),
        "base": hf_tokens(args.model, None, prompts, args.max_tokens),
        "edited": hf_tokens(args.model, args.operator, prompts, args.max_tokens),
    }
    hf["back"] = hf["edited"]
    if args.swap_operator:
        hf["swapped"] = hf_tokens(args.model, args.swap_operator, prompts, args.max_tokens)
    rows = [run_tp(args, tp, prompts, hf) for tp in args.tp]
    Path(args.out + ".json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    lines = ["| TP | decode edited / base | tokens vs HF (edited, base) | unrelated unchanged | swap |", "|---|---|---|---|---|"]
    for r in rows:
        swap = r.get("swap_agreement_vs_hf", "not run")
        lines.append(
            f"| {r['tp']} | {r['decode_ratio']:.3f} | {r['agreement_edited_vs_hf']:.2f}, {r['agreement_base_vs_hf']:.2f} "
            f"| {r['unrelated_unchanged']:.2f} | {swap}, storage kept: {r.get('swap_storage_unchanged')} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
