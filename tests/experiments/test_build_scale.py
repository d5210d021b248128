"""experiments.build_scale: per-stage costs of builds, per edit and against one process."""

from __future__ import annotations

from experiments.build_scale import processes, stage_costs, table


def _report(edits, **stages):
    return {"edits": edits, "stages": stages}


ONE = _report(100, **{"3_rollouts": {"seconds": 10.0, "cpu_seconds": 9.0, "peak_rss_gib": 2.0}})
TWO = _report(
    100,
    **{
        "3_rollouts": {
            "seconds": 4.0,
            "cpu_seconds": 4.5,
            "peak_rss_gib": 1.5,
            "cpu_seconds_all_ranks": 9.5,
            "peak_rss_gib_per_rank": [1.5, 1.75],
        },
        "4_refine": {"seconds": 3.0, "cpu_seconds": 3.0, "peak_rss_gib": 1.0, "resumed": True},
    },
)


def test_costs_count_every_process_and_leave_out_resumed_stages():
    costs = stage_costs(TWO)
    assert costs["3_rollouts"] == {"wall": 4.0, "cpu": 9.5, "peak_gib": 1.75}
    assert "4_refine" not in costs and costs["total"] == {"wall": 4.0, "cpu": 9.5, "peak_gib": 1.75}
    assert processes(TWO) == 2 and processes(ONE) == 1


def test_the_table_gives_per_edit_costs_and_the_speed_up_over_the_first_build_of_as_many_edits():
    rows = table({"one": ONE, "two": TWO}).splitlines()
    assert "| one | 100 | 1 | 3_rollouts | 10.0 | 9.0 | 2.00 | 100 | 90 | 1.00x |" in rows
    assert "| two | 100 | 2 | 3_rollouts | 4.0 | 9.5 | 1.75 | 40 | 95 | 2.50x |" in rows
