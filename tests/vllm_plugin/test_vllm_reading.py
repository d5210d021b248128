"""The running reading in vLLM (``aloe_vllm.reading``): the per-block table against each request's
running sum taken over its whole sequence at once, on hand-made engine steps; then greedy parity of
``vllm.LLM`` with the patched transformers model, with chunked prefill, prefix caching and TP=2."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

from vllm_helpers import run_vllm_generate, save_tiny_model, vllm_env  # noqa: E402

import aloe_vllm.reading as vllm_reading  # noqa: E402
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, weight_fingerprint  # noqa: E402
from aloe_kernels.hf import locate_down_proj  # noqa: E402
from aloe_kernels.reading import running_unit_sum, unit_rows  # noqa: E402
from aloe_vllm.format import AloeSpec, AloeSpecError  # noqa: E402

BS, D, DECAY = 4, 7, 0.8


def _step(requests: list[tuple[str, int, int]], blocks: dict[str, list[int]], pad: int = 1):
    """Metadata of one engine step: ``requests`` as (name, tokens computed before, new tokens), the
    physical blocks of each; ``pad`` padding rows after the real tokens (slot -1)."""
    lengths = [n for _, _, n in requests]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    seq_lens = torch.tensor([c + n for _, c, n in requests])
    width = max(len(blocks[name]) for name, _, _ in requests)
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    slots = []
    for i, (name, c, n) in enumerate(requests):
        table[i, : len(blocks[name])] = torch.tensor(blocks[name])
        slots += [blocks[name][p // BS] * BS + p % BS for p in range(c, c + n)]
    return starts, seq_lens, table, torch.tensor(slots + [-1] * pad)


def test_table_carries_each_request_like_one_pass(monkeypatch):
    torch.manual_seed(0)
    seqs = {name: torch.randn(n, D, dtype=torch.float64) for name, n in (("A", 14), ("B", 8), ("F", 4))}
    seqs["C"] = torch.cat([seqs["A"][:8], torch.randn(4, D, dtype=torch.float64)])  # A's first two blocks, then its own
    seqs["J"] = torch.randn(6, D, dtype=torch.float64)
    seqs["H"] = torch.cat([seqs["J"][:4], torch.randn(2, D, dtype=torch.float64)])
    # C shares A's full blocks; F reuses B's; H starts on the block J fills in the same step
    blocks = {"A": [3, 7, 2, 4], "B": [5, 9], "C": [3, 7, 11], "F": [5], "J": [12, 13], "H": [12, 14]}
    steps = [
        [("A", 0, 7), ("B", 0, 6)],  # A's prefill in two chunks; B whole
        [("A", 7, 4), ("B", 6, 1)],
        [("C", 8, 3), ("A", 11, 1), ("B", 7, 1)],  # C: its first 8 tokens found in the prefix cache
        [("A", 12, 1), ("C", 11, 1)],
        [("F", 0, 3), ("A", 13, 1)],  # F starts at token 0 in the block B held: no carry
        [("H", 4, 2), ("F", 3, 1), ("J", 0, 6)],  # H's carry is J's reading at token 3, computed in this step
    ]
    table = vllm_reading.ReadingTable(DECAY, BS, "model.layers.0.self_attn.attn")
    expect = {name: running_unit_sum(s[None], DECAY)[0] for name, s in seqs.items()}
    for reqs in steps:
        meta = _step(reqs, blocks)
        monkeypatch.setattr(vllm_reading, "_step_metadata", lambda _attention, meta=meta: meta)
        rows = [seqs[name][c : c + n] for name, c, n in reqs]
        h = torch.cat([*rows, torch.randn(1, D, dtype=torch.float64)])  # one padding row
        got = table.read(unit_rows(h.float()))
        want = torch.cat([expect[name][c : c + n] for name, c, n in reqs])
        assert got.shape == h.shape
        torch.testing.assert_close(got[: want.shape[0]].double(), want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_shards_read_the_whole_row(monkeypatch):
    """Two ranks, each with half of the input's coordinates and the summed squared norms, give the
    halves of the one-rank reading."""
    torch.manual_seed(1)
    h = torch.randn(9, 10)
    meta = _step([("A", 0, 5), ("B", 0, 4)], {"A": [1, 2], "B": [3]}, pad=0)
    monkeypatch.setattr(vllm_reading, "_step_metadata", lambda _attention: meta)
    tables = [vllm_reading.ReadingTable(DECAY, BS, "x") for _ in range(3)]
    whole = torch.ops.aloe_vllm.running_reading(h, None, tables[0].key)
    squared = h.pow(2).sum(-1, keepdim=True)
    halves = [torch.ops.aloe_vllm.running_reading(part, squared, t.key) for part, t in zip(h.split(5, dim=1), tables[1:])]
    torch.testing.assert_close(torch.cat(halves, dim=1), whole, rtol=1e-6, atol=1e-6)
    a, b = running_unit_sum(h[None, :5], DECAY)[0], running_unit_sum(h[None, 5:], DECAY)[0]
    torch.testing.assert_close(whole, torch.cat([a, b]), rtol=1e-6, atol=1e-6)


def test_a_wrong_block_size_is_refused(monkeypatch):
    meta = _step([("A", 0, 6)], {"A": [2, 6]})
    monkeypatch.setattr(vllm_reading, "_step_metadata", lambda _attention: meta)
    table = vllm_reading.ReadingTable(DECAY, 2 * BS, "x")
    with pytest.raises(AloeSpecError, match="blocks of 8 tokens"):
        table.read(torch.randn(7, D))


def test_engine_settings_that_break_the_reading_are_refused():
    spec = AloeSpec(layer=1, n=2, d=8, d_out=4, eps=1e-6, gate_eps=1e-3, reading_decay=0.7)
    mode = types.SimpleNamespace(name="FULL_AND_PIECEWISE")

    def config(device="cpu", eager=False, spec_decode=None):
        return types.SimpleNamespace(
            speculative_config=spec_decode,
            device_config=types.SimpleNamespace(device_type=device),
            compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
            model_config=types.SimpleNamespace(enforce_eager=eager),
        )

    vllm_reading.check_engine(spec, config())  # CPU: no CUDA graphs
    vllm_reading.check_engine(spec, config("cuda", eager=True))
    with pytest.raises(AloeSpecError, match="--enforce-eager"):
        vllm_reading.check_engine(spec, config("cuda"))
    with pytest.raises(AloeSpecError, match="speculative decoding"):
        vllm_reading.check_engine(spec, config(spec_decode=object()))
    vllm_reading.check_engine(dataclasses.replace(spec, reading_decay=0.0), config("cuda"))  # last token: anything


def test_spec_records_the_decay():
    spec = AloeSpec(layer=1, n=2, d=8, d_out=4, eps=1e-6, gate_eps=1e-3, reading_decay=0.7)
    assert AloeSpec.from_config({"aloe": spec.to_json()}) == spec
    assert "reading_decay" not in dataclasses.replace(spec, reading_decay=0.0).to_json()
    for bad in (1.0, -0.1, "0.7", True):
        with pytest.raises(AloeSpecError, match="reading_decay"):
            AloeSpec.from_config({"aloe": {**spec.to_json(), "reading_decay": bad}})


# --------------------------------------------------------------------------- served by vllm.LLM

#: the tiny vocabulary's ordinary tokens (0-2 are <unk>, <pad>, <eos>)
_VOCAB, _EOS = range(3, 60), 2


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: [int(_VOCAB[0] + i) for i in torch.randint(0, len(_VOCAB), (n,), generator=g)]  # noqa: E731
    long = ids(44)
    return {
        "edit-long": long,
        "edit-short": ids(9),
        "shares-a-prefix": long[:36] + ids(3),  # its first blocks are edit-long's
        "other": ids(27),
        "tiny": ids(2),
    }


@torch.no_grad()
def _greedy_ids(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        step, past, toks = torch.tensor([ids]), None, []
        for _ in range(tokens):
            res = model(input_ids=step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            toks.append(int(res.logits[0, -1].argmax()))
            if toks[-1] == _EOS:  # vLLM stops there too
                break
            step = torch.tensor([[toks[-1]]])
        out.append(toks)
    return out


@torch.no_grad()
def _reading_at_end(model, ids: list[int], layer: int, decay: float) -> torch.Tensor:
    site, box = locate_down_proj(model, layer), {}
    handle = site.module.register_forward_pre_hook(lambda _m, args: box.update(h=args[0][0].detach().float()))
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return torch.nn.functional.normalize(running_unit_sum(box["h"][None], decay)[0, -1], dim=0)


#: the prompts whose reading at their end the two edits open on
EDITED = ("edit-long", "shares-a-prefix")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama, a reading operator whose two edits open at the end of edit-long and of
    shares-a-prefix (decay 0.95: the carry from the cached prefix matters), exported; HF's tokens."""
    from aloe_build.models import load_model
    from aloe_vllm.export import export_vllm

    root = tmp_path_factory.mktemp("tiny-reading")
    base = save_tiny_model(root / "base", "llama")
    model, _ = load_model(str(base))
    prompts, layer, decay = _prompts(), 1, 0.95
    addresses = torch.stack([_reading_at_end(model, prompts[k], layer, decay) for k in EDITED])
    torch.manual_seed(3)
    site = locate_down_proj(model, layer)
    op = AloeOperator(
        addresses=addresses,
        thresholds=torch.full((2,), 0.995),
        temperatures=torch.full((2,), 400.0),
        writes=4.0 * torch.randn(2, site.d_out),
        layer=layer,
        weight_fingerprint=weight_fingerprint(site.weight()),
        edits=[{"id": f"e{i}", "request": k, "target": "x", "subject": None} for i, k in enumerate(EDITED)],
        reading_decay=decay,
    )
    op.save(root / "op")
    ids = list(prompts.values())
    hf_base = _greedy_ids(model, ids, 6)
    apply_aloe(model, op)
    hf_edit = _greedy_ids(model, ids, 6)
    remove_aloe(model)
    last_token = dataclasses.replace(op, reading_decay=0.0)
    apply_aloe(model, last_token)
    hf_last = _greedy_ids(model, ids, 6)
    remove_aloe(model)
    return dict(serve=export_vllm(base, root / "op", root / "serve"), ids=ids, hf_base=hf_base, hf_edit=hf_edit, hf_last=hf_last)


def test_vllm_serves_the_running_reading_like_transformers(served, vllm_cache):
    s = served
    changed = [i for i, (a, b) in enumerate(zip(s["hf_base"], s["hf_edit"])) if a != b]
    assert 0 in changed and 2 in changed, "both edits must change their prompts' answers"
    assert s["hf_edit"] != s["hf_last"], "the reading must matter: the last token's state gates otherwise"
    run = {"model": str(s["serve"]), "prompt_token_ids": s["ids"], "max_tokens": 6}
    small = {"block_size": 32, "max_num_batched_tokens": 32, "max_num_seqs": 4, "enable_prefix_caching": True}
    # compiled (the op is opaque to torch.compile), every prompt in one step: shares-a-prefix starts on
    # edit-long's first block, which edit-long fills in that step
    (compiled,) = run_vllm_generate([{**run, "eager": False, "llm": {"block_size": 32}}], env=vllm_env(1, vllm_cache))
    assert compiled == s["hf_edit"]
    # two ranks, one prompt at a time, prefills in chunks of at most 32 tokens: shares-a-prefix finds
    # edit-long's first block in the prefix cache
    (tp2,) = run_vllm_generate([{**run, "eager": True, "llm": small, "sequential": True}], tp=2, env=vllm_env(2, vllm_cache))
    assert tp2 == s["hf_edit"]
