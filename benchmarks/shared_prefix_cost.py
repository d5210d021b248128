"""Stage 3's edit-negative states collected several ways, timed in one process.

Takes a stream's edit-negative sequences in the order stage 3 runs them (sorted, so that a chunk
holds sequences with a common beginning), the first ``--sequences`` of them (one chunk is
``aloe_build.chunked.CHUNK_SEQUENCES``), and collects their states with a plain pass per sequence,
in token trees that run each distinct prefix once (``aloe_build.token_tree``, as the build does),
in token trees under bfloat16 autocast (the build's ``negatives_dtype="bfloat16"``) and, on request,
through a copy of the model whose linear layers run PyTorch's dynamic int8 kernels (``tree-int8``,
no build option: docs/results.md); prints each time, its ratio to the first way and how far its unit
states lie from the first way's. With ``--count`` it only counts, over the whole stream, the token
positions and the tree nodes that stage 3 runs.

    python -m benchmarks.shared_prefix_cost --edits $DATA/counterfact/counterfact-val.json --limit 839
    python -m benchmarks.shared_prefix_cost --edits runs/cf-stream.jsonl --limit 4000 --count
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch
from torch import nn

from aloe_build.config import BuildConfig
from aloe_build.corpus import load_corpus
from aloe_build.data import load_edits
from aloe_build.forward import in_precision
from aloe_build.models import default_layer, load_model
from aloe_build.rollouts import edit_negative_sequences, token_sequences
from aloe_build.slots import make_slots
from aloe_build.states import collect_states
from aloe_build.token_tree import PACK_TOKENS, TREES_PER_PASS, collect_states_tree, token_trees
from aloe_kernels.hf import locate_down_proj


def int8_copy(model: nn.Module, layer: int) -> nn.Module:
    """A copy of ``model`` whose linear layers run dynamic int8 products (weights per output channel,
    activations per tensor), except the edited down-projection, whose input is the state collected."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    down = locate_down_proj(model, layer).module
    spec = {name: per_channel_dynamic_qconfig for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not down}
    return quantize_dynamic(model, spec, inplace=False)


def sorted_edit_negatives(tok, edits: str, limit: int | None, cfg: BuildConfig
                          ) -> tuple[int, list[list[int]], list[list[int]]]:
    """The stream's edit count, and its edit-negative sequences and kept positions in stage 3's
    (sorted) order."""
    slots = make_slots(load_edits(edits, limit=limit))
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    seqs = token_sequences(tok, slots, corpus, cfg)
    spec, pos, _ = edit_negative_sequences(tok, slots, seqs, corpus, cfg, random.Random(cfg.seed))
    order = sorted(range(len(spec)), key=lambda i: tuple(spec[i]))
    return len(slots), [spec[i] for i in order], [pos[i] for i in order]


def linear_weights_below(model: nn.Module, layer: int) -> int:
    """Weights of the linear layers a pass runs up to the edited layer's down-projection (excluded)."""
    from aloe_kernels.hf import decoder_layers

    _, layers = decoder_layers(model)
    down = locate_down_proj(model, layer).module
    return sum(m.weight.numel() for block in list(layers)[: layer + 1] for m in block.modules()
               if isinstance(m, nn.Linear) and m is not down)


def gemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Best rate (GFLOP/s) of a float32 (size x size) @ (size x size) product on this process's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _profiled(on: bool):
    """torch's CPU profiler around the block when ``on`` (the way's time then includes its overhead)."""
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield prof


def count(edits: str, limit: int | None, model_name: str, cfg: BuildConfig) -> None:
    """Positions and tree nodes of a stream's edit negatives, chunk by chunk as stage 3 runs them."""
    from aloe_build.chunked import CHUNK_SEQUENCES

    _, tok = load_model(model_name)
    n, spec, pos = sorted_edit_negatives(tok, edits, limit, cfg)
    nodes = sum(len(t.tokens) for lo in range(0, len(spec), CHUNK_SEQUENCES)
                for t in token_trees(spec[lo: lo + CHUNK_SEQUENCES]))
    tokens, kept = sum(len(s) for s in spec), sum(len(p) for p in pos)
    print(f"{n} edits, {len(spec)} sequences: {tokens} token positions ({tokens / n:.1f} per edit), {kept} kept "
          f"as states ({kept / n:.1f}), {nodes} tree nodes run ({nodes / n:.1f} per edit, {nodes / tokens:.2f} "
          f"of the positions)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layer", type=int, default=None, help="default: the model's default edit layer")
    ap.add_argument("--sequences", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=BuildConfig.batch_size, help="sequences per plain pass")
    ap.add_argument("--ways", default="plain,tree,tree-bfloat16",
                    help="comma-separated, of plain (with an optional :B, B sequences per pass instead of "
                         "--batch-size), tree, tree-bfloat16, tree-int8 (with an optional :PxK, trees of P nodes, K "
                         "per pass); the first is the reference")
    ap.add_argument("--count", action="store_true",
                    help="only count, over all the stream's edit-negative sequences in the build's chunks: token "
                         "positions, positions kept as states and tree nodes (what the build runs), per edit too")
    ap.add_argument("--rate", action="store_true",
                    help="also the GFLOP/s of each way's linear-layer products, against one large float32 GEMM")
    ap.add_argument("--profile", action="store_true", help="also each way's top operators under torch's profiler")
    args = ap.parse_args(argv)
    cfg = BuildConfig()
    if args.count:
        return count(args.edits, args.limit, args.model, cfg)
    model, tok = load_model(args.model)
    layer = default_layer(model) if args.layer is None else args.layer
    n, spec, pos = sorted_edit_negatives(tok, args.edits, args.limit, cfg)
    spec, pos = spec[: args.sequences], pos[: args.sequences]
    tokens = sum(len(s) for s in spec)
    after_sharing = sum(len(t.tokens) for t in token_trees(spec))
    print(f"{n} slots, {len(spec)} sequences, {tokens} token positions, {after_sharing} "
          f"({after_sharing / tokens:.2f}) in token trees of {PACK_TOKENS}; layer {layer}, "
          f"{torch.get_num_threads()} threads")
    ways = {"plain": (collect_states, "float32"), "tree": (collect_states_tree, "float32"),
            "tree-bfloat16": (collect_states_tree, "bfloat16"), "tree-int8": (collect_states_tree, "int8")}
    chosen = args.ways.split(",")
    unknown = [w for w in chosen if w.split(":")[0] not in ways]
    if unknown:
        ap.error(f"unknown ways {unknown}; use {', '.join(ways)}")
    reference = None
    weights = linear_weights_below(model, layer) if args.rate else 0
    gemm = gemm_gflops() if args.rate else None
    if gemm is not None:
        print(f"one 2048^3 float32 GEMM: {gemm:.0f} GFLOP/s; {weights} linear weights up to the edited down-projection")
    for name in chosen:
        way, _, batch = name.partition(":")
        fn, precision = ways[way]
        runner = int8_copy(model, layer) if precision == "int8" else model
        t0 = time.perf_counter()
        with in_precision(model, "float32" if precision == "int8" else precision), _profiled(args.profile) as prof:
            if way != "plain":
                pack, _, per_pass = batch.partition("x")
                got = fn(runner, tok, spec, layer, pos, int(pack or PACK_TOKENS), int(per_pass or TREES_PER_PASS))
            else:
                got = fn(runner, tok, spec, layer, pos, int(batch) if batch else args.batch_size)
        seconds = time.perf_counter() - t0
        if prof is not None:
            print(f"{name}, under the profiler:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        if gemm is not None:
            # a plain pass also runs its padding, not counted here
            pack = int(batch.partition("x")[0] or PACK_TOKENS)
            positions = tokens if way == "plain" else sum(len(t.tokens) for t in token_trees(spec, pack))
            rate = 2 * positions * weights / seconds / 1e9
            print(f"{name}: {positions} positions, linear products at {rate:.0f} GFLOP/s ({rate / gemm:.2f} of the GEMM's)")
        if reference is None:
            reference = (seconds, got.states)
            print(f"{name}: {seconds:.1f} s")
            continue
        gap = (got.states - reference[1]).norm(dim=-1)
        print(f"{name}: {seconds:.1f} s ({seconds / reference[0]:.2f} of {chosen[0]}); distance of the unit states "
              f"from {chosen[0]}'s: mean {float(gap.mean()):.2e}, 99th percentile {float(gap.quantile(0.99)):.2e}, "
              f"max {float(gap.max()):.2e}")


if __name__ == "__main__":
    main()
