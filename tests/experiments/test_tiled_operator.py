"""experiments.tiled_operator: rows repeated in order, ids distinct, the reading as asked."""

from __future__ import annotations

import pytest
import torch

from aloe_kernels import AloeOperator
from experiments.tiled_operator import main, tiled


def _op(n: int = 3, d: int = 5, d_out: int = 4) -> AloeOperator:
    gen = torch.Generator().manual_seed(0)
    return AloeOperator(
        addresses=torch.randn(n, d, generator=gen),
        thresholds=torch.rand(n, generator=gen),
        temperatures=torch.rand(n, generator=gen) + 1.0,
        writes=torch.randn(n, d_out, generator=gen),
        edits=[{"id": f"e{i}", "request": f"r{i}", "target": "t", "subject": None} for i in range(n)],
        reading_decay=0.5,
    )


@pytest.mark.parametrize("slots", [1, 3, 7])
def test_rows_repeat_in_order_with_distinct_ids(slots, tmp_path):
    op = _op()
    for decay in (0.0, 0.85):
        got = tiled(op, slots, decay)
        rows = [i % op.n for i in range(slots)]
        for name in ("addresses", "thresholds", "temperatures", "writes"):
            assert torch.equal(getattr(got, name), getattr(op, name)[rows])
        assert len(set(got.ids)) == slots
        assert [e["request"] for e in got.edits] == [f"r{i}" for i in rows]
        assert got.reading_decay == decay
    path = main([str(op.save(tmp_path / "op")), "--slots", str(slots), "--reading-decay", "0", "--out", str(tmp_path / "t")])
    loaded = AloeOperator.load(path)
    assert loaded.n == slots and loaded.reading_decay == 0.0


def test_no_slots_is_an_error():
    with pytest.raises(ValueError, match="at least 1"):
        tiled(_op(), 0, 0.0)
