"""The running reading (:mod:`aloe_kernels.reading`) in vLLM: each request's reading carried from one
engine step to the next through the paged KV cache's own bookkeeping.

An operator with ``reading_decay`` d > 0 gates on ``r_t = d r_(t-1) + unit(h_t)`` over the request's
tokens so far. vLLM flattens a step's requests into one token axis (``query_start_loc`` marks where
each starts) and keeps no per-request state for a model layer, so the layer keeps one reading per
KV-cache block: the reading at the last token written into that block. A request whose first
``c`` tokens are already computed (an earlier chunk of its prefill, its decode so far, or a prefix
found in the prefix cache) takes its carry from the block that holds token ``c - 1``:

- a block the request is filling is written by that request only, so its entry is the request's own
  reading after token ``c - 1``;
- a full block found in the prefix cache holds the same tokens after the same prefix as when it was
  filled, so its entry (written at its last token) is the reading this request would have had.

A request that starts at token 0 (a new one, or one preempted and recomputed) has no carry. The block
of each token comes from the step's ``slot_mapping`` (slot // block size), the carry's block from the
``block_table``. The table holds one float32 row of the layer's input shard per block; it grows to
the largest block id seen.

What it needs of the engine, checked when the layer is built (:func:`check_engine`): no speculative
decoding (a step would verify draft tokens past the accepted ones) and, on a GPU, no CUDA graphs
(a replay would not run this bookkeeping); ``--enforce-eager`` serves it. With tensor parallelism
each rank keeps the reading of its own shard of the input, divided by the norm of the whole row (the
layer sums the shards' squared norms first).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from aloe_kernels.reading import READING_EPS, running_sum, unit_rows
from vllm.forward_context import get_forward_context, is_forward_context_available

from .format import AloeSpec, AloeSpecError

__all__ = ["ReadingTable", "check_engine", "running_reading"]

# Tables by the key their layer holds (the op, opaque to torch.compile, looks its table up).
_TABLES: dict[int, "ReadingTable"] = {}
_KEYS = itertools.count(1)


class ReadingTable:
    """One reading per KV-cache block of one layer (see the module docstring)."""

    def __init__(self, decay: float, block_size: int, attention: str):
        self.decay, self.block_size, self.attention = float(decay), int(block_size), attention
        self.rows: torch.Tensor | None = None
        self.key = next(_KEYS)
        _TABLES[self.key] = self

    def _fit(self, blocks: int, d: int, device: torch.device) -> torch.Tensor:
        rows = self.rows
        if rows is None or rows.shape[0] < blocks or rows.shape[1] != d or rows.device != device:
            grown = torch.zeros(max(blocks, 2 * (0 if rows is None else rows.shape[0])), d, dtype=torch.float32, device=device)
            if rows is not None and rows.shape[1] == d and rows.device == device:
                grown[: rows.shape[0]] = rows
            self.rows = rows = grown
        return rows

    def read(self, u: torch.Tensor) -> torch.Tensor:
        """The reading at every row of ``u`` (tokens, d), the unit states of this step's tokens."""
        meta = _step_metadata(self.attention)
        if meta is None:  # a profiling or warm-up pass: no requests, no carry
            return running_sum(u[None], self.decay)[0]
        starts, seq_lens, block_table, slot_mapping = meta
        self._check_block_size(starts, seq_lens, block_table, slot_mapping)
        out = torch.zeros_like(u)
        n_req = starts.numel() - 1
        if n_req <= 0:
            return out
        starts, seq_lens = starts.to(u.device).long(), seq_lens.to(u.device).long()
        lengths = starts[1:] - starts[:-1]
        computed = seq_lens[:n_req] - lengths  # tokens of each request before this step
        bs = self.block_size
        blocks = block_table[:n_req].to(u.device).long()
        tokens = int(starts[-1])
        slots = slot_mapping[:tokens].to(u.device).long()
        need = max(int(blocks.max()) if blocks.numel() else 0, int(slots.max()) // bs if tokens else 0) + 1
        rows = self._fit(need, u.shape[1], u.device)
        # what each token leaves behind: the reading at each block's last token and at each request's last
        req = torch.repeat_interleave(torch.arange(n_req, device=u.device), lengths)
        position = computed[req] + torch.arange(tokens, device=u.device) - starts[req]
        last = torch.zeros(tokens, dtype=torch.bool, device=u.device)
        last[(starts[1:] - 1)[lengths > 0]] = True
        keep = (((position + 1) % bs == 0) | last) & (slots >= 0)
        # the carry of each request: the entry of the block holding its token computed - 1
        col = ((computed - 1).clamp_min(0) // bs).clamp_max(blocks.shape[1] - 1)
        held = torch.where(computed > 0, blocks.gather(1, col[:, None])[:, 0], -1)
        decode = lengths == 1
        if bool(decode.any()):  # one new token: r = d carry + u, all such requests at once
            at = starts[:-1][decode]
            out[at] = self.decay * self._carry(rows, held[decode]).to(u.dtype) + u[at]
            rows[slots[at][keep[at]] // bs] = out[at][keep[at]].to(rows.dtype)
        self._prefills(u, out, rows, starts, held, keep, slots, (~decode & (lengths > 0)).nonzero().flatten().tolist())
        return out

    def _prefills(self, u, out, rows, starts, held, keep, slots, requests: list[int]) -> None:
        """The requests of more than one token, each after the request whose tokens this step fill the
        block it carries from: the prefix cache lets a request start on a block that another request of
        the same step is filling."""
        bs = self.block_size
        spans = {i: (int(starts[i]), int(starts[i + 1])) for i in requests}
        filler = {int(b): i for i, (lo, hi) in spans.items() for b in (slots[lo:hi][keep[lo:hi]] // bs).tolist()}
        # the request each one waits for: the filler of its carry's block, where that is another request
        source = {i: filler.get(int(held[i]), i) for i in requests}
        waiting, done = list(requests), set()
        while waiting:
            ready = [i for i in waiting if source[i] == i or source[i] in done]
            if not ready:
                raise AloeSpecError("ALOE: the running reading found requests that carry from each other's blocks")
            for i in ready:
                lo, hi = spans[i]
                out[lo:hi] = running_sum(u[None, lo:hi], self.decay, carry=self._carry(rows, held[i : i + 1]))[0]
                mine = keep[lo:hi]
                rows[slots[lo:hi][mine] // bs] = out[lo:hi][mine].to(rows.dtype)
                done.add(i)
            waiting = [i for i in waiting if i not in done]

    @staticmethod
    def _carry(rows: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """The entries of blocks ``held`` (-1: no carry, zeros)."""
        return torch.where((held >= 0)[:, None], rows[held.clamp_min(0)], torch.zeros((), dtype=rows.dtype, device=rows.device))

    def _check_block_size(self, starts, seq_lens, block_table, slot_mapping) -> None:
        """Refuse a block size that does not map the first request's last token to its slot (the
        table would mix up requests)."""
        if starts.numel() < 2 or int(starts[1]) < 1 or block_table.numel() == 0:
            return
        position = int(seq_lens[0]) - 1
        block = int(block_table[0, position // self.block_size]) if position // self.block_size < block_table.shape[1] else -1
        slot = int(slot_mapping[int(starts[1]) - 1])
        if slot >= 0 and slot != block * self.block_size + position % self.block_size:
            raise AloeSpecError(
                f"ALOE: the running reading assumed KV-cache blocks of {self.block_size} tokens, which the "
                "step's slot mapping contradicts; this vLLM build lays out its cache differently"
            )


def _step_metadata(attention: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(query_start_loc, seq_lens, block_table, slot_mapping) of this step, from the attention
    metadata of the edited layer's own attention (``attention``, its vLLM prefix), else any; None
    where there is none (vLLM's profiling run)."""
    if not is_forward_context_available():
        return None
    metas = get_forward_context().attn_metadata
    if not isinstance(metas, dict) or not metas:
        return None
    meta = metas.get(attention, next(iter(metas.values())))
    fields = [getattr(meta, name, None) for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")]
    if any(not isinstance(f, torch.Tensor) for f in fields):
        return None
    return tuple(fields)  # type: ignore[return-value]


@torch.library.custom_op("aloe_vllm::running_reading", mutates_args=())
def running_reading(h: torch.Tensor, squared_norms: Optional[torch.Tensor], key: int) -> torch.Tensor:
    """The running reading of the rows of ``h`` (tokens, d) in ``h``'s dtype; ``squared_norms``
    (tokens, 1): the rows' squared norms summed over the tensor-parallel shards (None with one rank);
    ``key``: the layer's table."""
    table = _TABLES[key]
    u = unit_rows(h, READING_EPS, squared_norms)
    return table.read(u).to(h.dtype)


@running_reading.register_fake
def _running_reading_fake(h, squared_norms, key):
    return torch.empty_like(h)


def check_engine(spec: AloeSpec, vllm_config: Any) -> None:
    """Refuse an engine setting under which a running reading would be wrong (see the module docstring)."""
    if not spec.reading_decay:
        return
    what = f"the operator's gates read a running mean (reading_decay={spec.reading_decay})"
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise AloeSpecError(f"{what}, which speculative decoding would advance past the accepted tokens; serve without it")
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    eager = bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False))
    graphs = mode is not None and getattr(mode, "name", str(mode)) != "NONE"
    if device == "cuda" and graphs and not eager:
        raise AloeSpecError(f"{what}, which a CUDA graph replay would not update; serve with --enforce-eager")
