"""Tests of labs/lab09_schedules.py (pure, no processes): interleaved 1F1B and ZB-H1 as data,
valid, with the bubble and memory their papers give; the simulator over ranks, torch's order
format, the planner's pipeline timing, and registration into notebook 06's registry.
"""
from __future__ import annotations

import pytest

from labs import lab06_schedules as sched
from labs import lab09_schedules as s9


def spell(row) -> str:
    return " ".join(f"{k}{mb}s{stage}" for k, mb, stage in row)


def test_interleaved_needs_two_chunks_and_the_planner_times_1f1b_as_gpipe():
    """One chunk per rank is notebook 06's 1F1B exercise: not produced here (it would ship in the
    student edition). The planner times 1F1B with GPipe's order (same makespan) and counts its
    activations as 1F1B holds them (p on rank 0)."""
    with pytest.raises(ValueError, match="v >= 2"):
        s9.interleaved_1f1b(4, 8, 1)
    gpipe, one_f_one_b = (s9.pipeline_timing(name, 4, 8, 1.0, 2.0) for name in ("GPipe", "1F1B"))
    assert one_f_one_b["makespan"] == gpipe["makespan"]
    assert (one_f_one_b["peak_held"], gpipe["peak_held"]) == (4, 8)


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_interleaved_valid_bubble_and_memory(p, v):
    """Interleaved 1F1B: valid, bubble (p-1)/(v m) of the ideal time, rank 0 holds p (1 + (p-1)/(p v))."""
    for m in (p, 2 * p, 4 * p):
        schedule = s9.interleaved_1f1b(p, m, v)
        s9.validate_ranks(schedule, m)
        assert s9.stage_owner(schedule) == {c * p + r: r for r in range(p) for c in range(v)}
        timeline = s9.simulate_ranks(schedule, s9.chunk_durations("interleaved 1F1B", 1.0, 2.0, v))
        assert sched.bubble_ratio(timeline) == pytest.approx((p - 1) / (v * m)), (p, m, v)
        assert s9.peak_held(schedule)[0] == pytest.approx(min(m * 1.0, p * (1 + (p - 1) / (p * v)))), (p, m, v)


def test_interleaved_needs_whole_groups_of_p():
    """Megatron's interleaving runs micro-batches in groups of p: m % p != 0 is refused."""
    with pytest.raises(ValueError, match="divisible"):
        s9.interleaved_1f1b(4, 6, 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zero_bubble_h1(p):
    """ZB-H1: valid with kinds F, B, W; bubble (p-1) T_F when F = B = W; never more than p held."""
    for m in (1, 2, p, 3 * p):
        schedule = s9.zero_bubble_h1(p, m)
        sched.validate_schedule(schedule, m, kinds="FBW")
        s9.validate_ranks(s9.from_stages(schedule), m, kinds="FBW")
        assert max(sched.peak_in_flight(schedule)) <= min(p, m)
        if m >= p:
            timeline = sched.simulate_schedule(schedule, durations={"F": 1.0, "B": 1.0, "W": 1.0})
            assert sched.makespan(timeline) == pytest.approx(3 * m + p - 1), (p, m)


def test_timing_against_the_formulas():
    """pipeline_timing: 1F1B = GPipe = (p-1)/m, interleaved (p-1)/(vm), ZB-H1 (p-1)(tF+tB/2) idle."""
    p, m = 4, 8
    one = s9.pipeline_timing("1F1B", p, m, 1.0, 2.0)
    assert one["bubble_ratio"] == pytest.approx((p - 1) / m)
    assert s9.pipeline_timing("GPipe", p, m, 1.0, 2.0)["bubble"] == pytest.approx(one["bubble"])
    assert one["peak_held"] == p and s9.pipeline_timing("GPipe", p, m, 1.0, 2.0)["peak_held"] == m
    assert s9.pipeline_timing("interleaved 1F1B", p, m, 1.0, 2.0, 2)["bubble_ratio"] == pytest.approx((p - 1) / (2 * m))
    assert s9.pipeline_timing("ZB-H1", p, m, 1.0, 2.0)["bubble"] == pytest.approx((p - 1) * 1.0)
    assert s9.pipeline_timing("1F1B", 1, m, 1.0, 2.0)["bubble"] == 0.0
    scaled = s9.pipeline_timing("1F1B", p, m, 3e-3, 6e-3)
    assert scaled["makespan"] == pytest.approx(one["makespan"] * 3e-3)
    with pytest.raises(ValueError):
        s9.pipeline_timing("1F1B", p, m, 0.0, 1.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        s9.pipeline_timing("PipeDream-2BW", p, m, 1.0, 2.0)


def test_timing_matches_a_direct_simulation():
    """The cached timing (ratio to 3 digits) stays within 0.1% of simulating the exact times."""
    for name, v in (("1F1B", 1), ("interleaved 1F1B", 2), ("ZB-H1", 1)):
        t_f, t_b = 1.234e-3, 2.71828e-3
        direct = sched.makespan(s9.simulate_ranks(s9.planner_schedule(name, 4, 8, v),
                                                  s9.chunk_durations(name, t_f, t_b, v)))
        assert s9.pipeline_timing(name, 4, 8, t_f, t_b, v)["makespan"] == pytest.approx(direct, rel=1e-3)


def test_simulator_rejects_bad_schedules():
    """validate_ranks / simulate_ranks: a missing action, a stage on two ranks, a deadlock."""
    good = s9.interleaved_1f1b(2, 2, 2)
    with pytest.raises(ValueError, match="never runs"):
        s9.validate_ranks([good[0][:-1], good[1]], 2)
    with pytest.raises(ValueError, match="ranks"):
        s9.stage_owner([[("F", 0, 0)], [("F", 0, 0)]])
    backwards_first = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 1), ("B", 0, 1)]]
    with pytest.raises(ValueError):
        s9.validate_ranks(backwards_first, 1)
    with pytest.raises(sched.ScheduleDeadlock):
        s9.simulate_ranks([[("F", 0, 0), ("F", 0, 2), ("B", 0, 2), ("B", 0, 0)],
                           [("B", 0, 1), ("F", 0, 1)]], {"F": 1.0, "B": 1.0})


def test_from_torch_reads_pipeline_order():
    """torch's printed actions ("2F0", "1I3", "0W1", None) become (kind, microbatch, stage)."""
    order = {0: ["0F0", None, "0I0", "0W0"], 1: [None, "1F0", "1B0"]}
    assert s9.from_torch(order) == [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 0, 1), ("B", 0, 1)]]
    assert s9.from_torch({"0": ["0F0"]}) == [[("F", 0, 0)]]
    with pytest.raises(ValueError):
        s9.from_torch({0: ["0UNSHARD"]})


def test_registers_into_notebook_06(monkeypatch):
    """register_schedules adds ZB-H1 to notebook 06's registry (and only then: import leaves it)."""
    assert "ZB-H1" not in sched.SCHEDULES
    monkeypatch.setattr(sched, "SCHEDULES", dict(sched.SCHEDULES))
    s9.register_schedules()
    assert sched.make_schedule("ZB-H1", 3, 4) == s9.zero_bubble_h1(3, 4)
    assert "W" in sched.DEPENDENCIES


def test_comparison_rows_and_drawing():
    """The lab's table and the Gantt chart of several chunks per rank (Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = s9.comparison_rows(4, 8, extra={"torch-like": s9.interleaved_1f1b(4, 8, 2)})
    assert [r["schedule"] for r in rows][:2] == ["GPipe", "1F1B"] and len(rows) == 5
    assert rows[-1]["bubble / ideal"] == pytest.approx(rows[2]["bubble / ideal"])
    timeline = s9.simulate_ranks(s9.interleaved_1f1b(2, 4, 2), {"F": 0.5, "B": 1.0})
    ax = s9.plot_ranks(timeline, title="interleaved")
    assert ax.get_title() == "interleaved" and len(ax.patches) == 32
    plt.close("all")
