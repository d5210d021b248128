"""Does vLLM serve a built operator whose gates read a running mean token for token as the Hugging
Face patch does, on SmolLM2, with chunked prefill and prefix caching?

For the first ``--limit`` edits of ``EDITS``: the request, the request after an unrelated sentence, its
first rewording and the request asked through the chat template (the default system prompt, and
:data:`aloe_eval.chat.CUSTOM_SYSTEM`). The patched transformers model answers greedily
(``--tokens``, batched with left padding, as ``aloe eval`` asks); vLLM (fp32, eager) answers the same
token ids from the exported operator under two engine settings: its defaults, and 32-token KV blocks
with prefills chunked to ``--chunk`` tokens and the prefix cache on (every chat prompt starts with the
same template head, so later prompts start on blocks filled by earlier ones). Run it with
``.venv-vllm/bin/python``. Writes the counts of identical answers per kind and setting.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

#: vLLM's CPU engine in this process (read when vLLM is imported)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _prompts(tokenizer, requests) -> dict[str, list[list[int]]]:
    from aloe_build.tokens import chat_prompt, encode_prompt
    from aloe_eval.chat import CUSTOM_SYSTEM
    from aloe_eval.in_context import request_in_context

    return {
        "request": [encode_prompt(tokenizer, r.prompt) for r in requests],
        "in_context": [encode_prompt(tokenizer, request_in_context(r.prompt, i)[0]) for i, r in enumerate(requests)],
        "rewording": [encode_prompt(tokenizer, r.rephrases[0]) for r in requests if r.rephrases],
        "chat": [chat_prompt(tokenizer, r.prompt, None) for r in requests],
        "chat_custom_system": [chat_prompt(tokenizer, r.prompt, CUSTOM_SYSTEM) for r in requests],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("operator")
    ap.add_argument("edits")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--skip-invalid", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from aloe_build import load_edits, load_model
    from aloe_build.forward import greedy_generate
    from aloe_build.tokens import pad_id, stop_ids, until_end
    from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
    from aloe_vllm.export import export_vllm, resolve_base

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    op = AloeOperator.load(args.operator)
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    model, tokenizer = load_model("smollm2", dtype="float32")
    prompts = _prompts(tokenizer, requests)
    stops = stop_ids(tokenizer)
    apply_aloe(model, op)
    hf = {
        kind: [until_end(g, stops) for g in greedy_generate(model, ids, args.tokens, pad_id=pad_id(tokenizer), batch_size=16)]
        for kind, ids in prompts.items()
    }
    remove_aloe(model)
    del model

    from vllm import LLM, SamplingParams

    settings = {
        "defaults": {},
        "chunked_prefix_cache": {"block_size": 32, "max_num_batched_tokens": args.chunk, "enable_prefix_caching": True},
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, detokenize=False)
    result = {"operator": str(args.operator), "reading_decay": op.reading_decay, "edits": len(requests), "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        served = export_vllm(resolve_base("smollm2"), args.operator, Path(tmp) / "serve")
        for name, extra in settings.items():
            llm = LLM(model=str(served), dtype="float32", enforce_eager=True, max_model_len=512, seed=0, **extra)
            same = {}
            for kind, ids in prompts.items():
                outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
                got = [until_end(list(o.outputs[0].token_ids), stops) for o in outs]
                same[kind] = {"identical": sum(a == b for a, b in zip(got, hf[kind])), "of": len(ids)}
            result[name] = same
            print(name, json.dumps(same), flush=True)
            del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
