"""A build spread over two processes (torch.distributed, gloo) against the same build in one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_pipeline import _edits, _tiny_cfg
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build import build_operator, distributed
from aloe_cli.launch import launch_python, without_procs
from aloe_kernels import AloeOperator
from aloe_kernels.hf import apply_aloe, remove_aloe

SCRIPT = Path(__file__).with_name("distributed_tiny_build.py")
# every stage's work split between the ranks: two chunks per pass, two sequences per stage 8 batch
SPLIT = dict(finetune_batch=4, target_batch=2, finetune_steps=6)
CHUNK = 4  # sequences per chunk of a pass: many chunks, dealt out to both processes
BLOCK = 2  # slots per block of stage 5, states per block of stage 7: blocks for both processes


def _distributed_build(tmp_path: Path, procs: int, *flags: str, **fields) -> int:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(_tiny_cfg(tmp_path, **SPLIT, **fields).to_dict()))
    return launch_python([str(SCRIPT), str(cfg), str(tmp_path / "dist"), *flags], procs)


def _tokenizer(chat: bool):
    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE if chat else None
    return tok


def _greedy(op: AloeOperator, prompts: list[str], tok) -> list[list[int]]:
    model = tiny_model("llama")
    apply_aloe(model, op)
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out.append(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)[0, ids.shape[1] :].tolist())
    remove_aloe(model)
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-slots"])
def test_two_processes_build_the_operator_of_one(tmp_path, chat, monkeypatch):
    from safetensors.torch import load_file

    from aloe_build import chunked, open_gates
    from aloe_build.stages import s5_calibrate

    monkeypatch.setattr(chunked, "CHUNK_SEQUENCES", CHUNK)
    monkeypatch.setattr(s5_calibrate, "CALIBRATION_BLOCK", BLOCK)
    monkeypatch.setattr(open_gates, "BLOCK_ROWS_MIN", BLOCK)
    monkeypatch.setattr(open_gates, "BLOCK_BYTES", 0)
    fields = dict(positives_chat=True, chat_slots=True, refine_active_every=5) if chat else {}
    tok = _tokenizer(chat)
    cfg = _tiny_cfg(tmp_path, **SPLIT, **fields)
    one = build_operator(tiny_model("llama"), tok, _edits(), cfg, out_dir=tmp_path / "one", log=None)
    flags = ["--chunk", str(CHUNK), "--block", str(BLOCK), *(["--chat"] if chat else [])]
    assert _distributed_build(tmp_path, 2, *flags, **fields) == 0
    two = AloeOperator.load(tmp_path / "dist" / "op")
    # the passes' chunks are computed alike wherever they run, each refinement step is the one of one
    # process, and each slot is calibrated by one rank: states, addresses and gates the same bit for bit
    for stage in ("3_rollouts", "4_refine", "5_calibrate"):
        a, b = (load_file(str(d / "checkpoints" / f"{stage}.safetensors")) for d in (tmp_path / "one", tmp_path / "dist" / "run"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage
    for name in ("addresses", "thresholds", "temperatures", "writes"):
        a, b = getattr(one, name).double(), getattr(two, name).double()
        # the same math, summed in another order: float32 rounding apart
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(a.abs().max())), name
    report = json.loads((tmp_path / "dist" / "run" / "build_report.json").read_text())
    assert report["stages"]["8_finetune"]["steps"] == 6
    # stage 7's blocks of states are gated by both ranks: the negatives' gates counted once each
    one_report = json.loads((tmp_path / "one" / "build_report.json").read_text())
    for key in ("negative_any_open_share", "negative_max_gate"):
        assert report["stages"]["7_ridge"][key] == one_report["stages"]["7_ridge"][key], key
    for stage in ("3_rollouts", "8_finetune"):  # each rank's time and memory are reported
        assert report["stages"][stage]["cpu_seconds_all_ranks"] >= report["stages"][stage]["cpu_seconds"]
        assert len(report["stages"][stage]["peak_rss_gib_per_rank"]) == 2
    prompts = [e.prompt for e in _edits()] + ["The capital of Italy is", "John Lennon plays the"]
    assert _greedy(one, prompts, tok) == _greedy(two, prompts, tok)


def test_more_processes_than_edits(tmp_path):
    """A process with no slot of its own still takes part in every pass and step."""
    one = build_operator(
        tiny_model("llama"), tiny_tokenizer(), _edits()[:1], _tiny_cfg(tmp_path, **SPLIT), out_dir=tmp_path / "one", log=None
    )
    assert _distributed_build(tmp_path, 2, "--first", "1") == 0
    two = AloeOperator.load(tmp_path / "dist" / "op")
    assert two.n == 1 and torch.allclose(one.writes, two.writes, rtol=1e-4, atol=1e-6)
    assert torch.allclose(one.addresses, two.addresses, rtol=1e-4, atol=1e-6)


def test_a_distributed_build_resumes_in_one_process(tmp_path):
    assert _distributed_build(tmp_path, 2) == 0
    cfg = _tiny_cfg(tmp_path, **SPLIT)
    again = build_operator(tiny_model("llama"), tiny_tokenizer(), _edits(), cfg, out_dir=tmp_path / "dist" / "run", log=None)
    report = json.loads((tmp_path / "dist" / "run" / "build_report.json").read_text())
    assert all(report["stages"][s].get("resumed") for s in ("2_init", "3_rollouts", "6_targets", "8_finetune"))
    assert again.fingerprint() == AloeOperator.load(tmp_path / "dist" / "op").fingerprint()


def test_a_failed_process_stops_the_build_and_is_named(tmp_path, capfd):
    assert _distributed_build(tmp_path, 2, "--fail", "6_targets") == 2
    err = capfd.readouterr().err
    assert "rank 1 failed in stage 6_targets" in err and "injected failure" in err
    assert "error: of 2 processes" in err
    assert not (tmp_path / "dist" / "op").exists()
    # the stages before it were kept: a rerun resumes from them
    assert (tmp_path / "dist" / "run" / "checkpoints" / "5_calibrate.safetensors").is_file()


def test_one_process_is_its_own_group():
    assert (distributed.world_size(), distributed.rank(), distributed.is_main()) == (1, 0, True)
    t = torch.arange(3.0)
    assert distributed.summed(t) is t and distributed.gathered(5) == [5] and distributed.from_main("x") == "x"
    assert list(distributed.share(7)) == list(range(7))


def test_a_share_of_the_slots_mines_their_rows_of_the_whole_mining():
    """NegativeSet.top on some slots' rows (a rank's share) gives those slots' rows of the top of all."""
    from aloe_build.slot_sets import NegativeSet
    from aloe_build.slots import SamePrompt

    g = torch.Generator().manual_seed(3)
    n, d, k = 7, 5, 3
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    negatives = NegativeSet(
        shared=unit(torch.randn(40, d, generator=g)),
        shared_owner=torch.randint(-1, n, (40,), generator=g),
        specific=unit(torch.randn(23, d, generator=g)),
        specific_owner=torch.randint(0, n, (23,), generator=g),
    )
    V = torch.randn(n, d, generator=g, dtype=torch.float64).float()
    prompt_ids = torch.arange(n)
    prompt_ids[4] = 1  # slots 1 and 4 share a prompt
    same = SamePrompt(prompt_ids, prompt_ids)
    all_s, all_h = negatives.top(V, same, k)
    _, candidates = negatives.shared_candidates(V, same, 6)
    cand_s, cand_h = negatives.top(V, same, k, candidates=candidates)
    for share in ([4, 5, 6], [0], [], [2, 1]):
        h = torch.tensor(share, dtype=torch.long)
        # the same negatives; their scores from a product of other shape, so within float32 rounding
        s, st = negatives.top(V[h], same[h], k, slots=h)
        assert torch.allclose(s, all_s[h], atol=1e-6) and torch.equal(st, all_h[h])
        s, st = negatives.top(V[h], same[h], k, candidates=candidates[h], slots=h)
        assert torch.allclose(s, cand_s[h], atol=1e-6) and torch.equal(st, cand_h[h])


@pytest.mark.parametrize(
    "argv, left",
    [
        (["build", "--procs", "2", "--out", "x"], ["build", "--out", "x"]),
        (["build", "--procs=3", "--model", "m"], ["build", "--model", "m"]),
    ],
)
def test_the_relaunched_command_leaves_out_procs(argv, left):
    assert without_procs(argv) == left


def test_procs_must_be_positive(capsys):
    from aloe_cli.main import main

    with pytest.raises(SystemExit):
        main(["build", "--model", "m", "--edits", "e", "--out", "o", "--procs", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_aloe_build_procs_runs_the_command_in_two_processes(tmp_path):
    """`aloe build --procs 2` on a tiny model directory: the same artifact as `aloe build`."""
    import subprocess
    import sys

    from aloe_build import save_edits_jsonl

    model_dir, tok = tmp_path / "model", tiny_tokenizer()
    tiny_model("llama").save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    save_edits_jsonl(_edits(), tmp_path / "edits.jsonl")
    (tmp_path / "cfg.json").write_text(json.dumps(_tiny_cfg(tmp_path, **SPLIT).to_dict()))
    common = ["--model", str(model_dir), "--edits", str(tmp_path / "edits.jsonl"), "--config", str(tmp_path / "cfg.json")]
    for out, extra in (("one", []), ("two", ["--procs", "2"])):
        run = subprocess.run(
            [sys.executable, "-m", "aloe_cli", "build", *common, "--out", str(tmp_path / out), *extra],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    assert "by 2 processes" in run.stdout and run.stdout.count("wrote 4 edits") == 1  # rank 0 alone reports
    one, two = (AloeOperator.load(tmp_path / d) for d in ("one", "two"))
    assert torch.equal(one.addresses, two.addresses) and torch.allclose(one.writes, two.writes, rtol=1e-4, atol=1e-6)
