"""Tests of lab 14's models (no launch): Daly's goodput against a simulation of the same story,
Young's and Daly's intervals against the scan, the published cluster's numbers, per-step fault
tolerance, the accounting of a run's time, where each method fits, and every verdict the notebook
prints fed both ways.

Run:  .venv/bin/python -m pytest tests/test_lab14_goodput.py -q
"""
from __future__ import annotations

import math
import statistics

import pytest

from labs import lab14_fit as fit
from labs import lab14_goodput as gp
from labs.lab14_failures import account_ft, account_restart, per_failure_cost, step_spread

HOUR = gp.HOUR


def test_daly_goodput_is_what_a_simulated_job_keeps():
    """The formula against 30 simulated 200-hour jobs with exponential failures, at three intervals."""
    mtbf, delta, restart = 3 * HOUR, 120.0, 600.0
    for tau in (300.0, gp.daly_interval(delta, mtbf), 4 * HOUR):
        sims = [gp.simulate_restart(tau, delta, restart, mtbf, work=200 * HOUR, seed=s)["goodput"]
                for s in range(30)]
        error = statistics.stdev(sims) / len(sims) ** 0.5
        assert gp.restart_goodput(tau, delta, restart, mtbf) == pytest.approx(statistics.mean(sims), abs=4 * error + 1e-3)


def test_no_failures_leaves_only_the_checkpoint_cost():
    assert gp.restart_goodput(100.0, 10.0, 50.0, 1e12) == pytest.approx(100 / 110, rel=1e-6)
    assert gp.simulate_restart(100.0, 10.0, 50.0, 1e15, work=1000.0)["failures"] == 0


def test_intervals_and_the_optimum():
    """Young's sqrt(2 delta M); Daly's estimate is the scanned optimum to within a percent of goodput."""
    assert gp.young_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    for delta, mtbf, restart in ((60.0, 3 * HOUR, 600.0), (600.0, HOUR, 60.0), (5.0, 10 * HOUR, 0.0)):
        daly = gp.daly_interval(delta, mtbf)
        best = gp.best_interval(delta, restart, mtbf)
        assert gp.restart_goodput(daly, delta, restart, mtbf) >= 0.99 * gp.restart_goodput(best, delta, restart, mtbf)
        assert daly < gp.young_interval(delta, mtbf)        # Daly subtracts delta and more
    assert gp.daly_interval(3 * HOUR, HOUR) == HOUR          # delta >= 2 M: checkpoint every M


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="mtbf must be a positive number"):
        gp.restart_goodput(10.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one replica group"):
        gp.ft_goodput(0, 1.0, 1.0, 100.0)


def test_llama3_numbers():
    """Dubey et al. 2024, section 3.3.4: 419 unexpected interruptions in 54 days: one every ~3.1 h."""
    assert gp.llama3_mtbf_s() / HOUR == pytest.approx(54 * 24 / 419)
    assert 3.0 < gp.llama3_mtbf_s() / HOUR < 3.2


def test_torchft_loses_a_group_share_of_the_heal():
    assert gp.ft_goodput(4, heal=400.0, step=0.0, mtbf=1000.0) == pytest.approx(0.9)
    assert gp.ft_goodput(1, heal=400.0, step=0.0, mtbf=1000.0) == pytest.approx(0.6)
    assert gp.ft_goodput(2, heal=10_000.0, step=1.0, mtbf=1000.0) == 0.0


# ------------------------------------------------------------------------- accounting a run
def restart_events():
    """Rank 0 of a restart run: attempt 0 does steps 0-4, checkpoints after 4, dies before 5...
    attempt 1 loads step 4's checkpoint and does 4-7. Steps take 1 s; checkpoints 0.5 s."""
    a0 = {"steps": [[s, 10.0 + s, 11.0 + s, 5.0] for s in range(4)] + [[4, 14.5, 15.5, 4.0]],
          "checkpoints": [[4, 14.0, 14.5]], "load": None}
    a1 = {"steps": [[s, 30.0 + s - 4, 31.0 + s - 4, 3.0] for s in range(4, 8)], "checkpoints": [],
          "load": [29.0, 29.5, 4]}
    return {"attempt0": a0, "attempt1": a1}


def test_account_restart():
    acc = account_restart(restart_events())
    assert acc["wall"] == pytest.approx(34.0 - 10.0)
    assert acc["kept"] == pytest.approx(8.0)
    assert acc["recomputed"] == pytest.approx(1.0) and acc["steps_recomputed"] == 1
    assert acc["checkpoints"] == pytest.approx(0.5)
    assert acc["restart_each"] == [pytest.approx(30.0 - 15.5)] and acc["load_each"] == [pytest.approx(0.5)]
    assert acc["losses"] == [5.0, 5.0, 5.0, 5.0, 3.0, 3.0, 3.0, 3.0]


def ft_events():
    """Two groups; group 1 dies in step 2 (discarded for group 0), is down 10 s, heals at step 9."""
    def row(step, t, committed=True, groups=2, loss=1.0):
        return [step, t, t + 0.1, t + 0.5, t + 0.6, t + 1.0, committed, groups, loss]

    g0 = [row(0, 0.0), row(1, 1.0), row(2, 2.0, committed=False)] + \
        [row(s, 1.0 + s, groups=1) for s in range(2, 9)] + [row(9, 10.0), row(10, 11.0)]
    g1a = [row(0, 0.0), row(1, 1.0)]
    g1b = [row(9, 10.0), row(10, 11.0)]
    return [[{"attempt0": {"steps": g0, "heals": []}}],
            [{"attempt0": {"steps": g1a, "heals": []}, "attempt1": {"steps": g1b, "heals": [[10.0, 10.1, 9]]}}]]


def test_account_ft():
    acc = account_ft(ft_events())
    assert acc["wall"] == pytest.approx(12.0)
    g0, g1 = acc["groups"]
    assert g0["kept"] == pytest.approx(11.0) and g0["discarded"] == pytest.approx(1.0) and g0["down"] == 0
    assert g1["down"] == pytest.approx(10.0 - 2.0) and g1["attempts"] == 2 and g1["heals"] == [[10.0, 10.1, 9]]
    assert [l[0] for l in acc["losses"]] == list(range(11))


def test_per_failure_cost_and_its_verdict_flip():
    """The side-by-side verdict names whichever run lost less, and says "within the noise" when close."""
    cost = per_failure_cost(account_restart(restart_events()), account_ft(ft_events()), replicas=2)
    assert cost["whole-job restart"] == pytest.approx(14.5 + 1.0)
    assert cost["torchft"] == pytest.approx(8.0 / 2 + 0.5)
    assert gp.compare_goodput(0.5, 0.9, noise=0.05).startswith("torchft kept more")
    assert gp.compare_goodput(0.9, 0.5, noise=0.05).startswith("whole-job restart kept more")
    assert gp.compare_goodput(0.70, 0.72, noise=0.05).startswith("within the noise")
    assert gp.compare_cost(10.0, 4.0, noise=0.2).startswith("torchft lost 2.5x less")
    assert gp.compare_cost(4.0, 10.0, noise=0.2).startswith("the whole-job restart lost 2.5x less")
    assert gp.compare_cost(10.0, 9.0, noise=0.2).startswith("within the noise")


def test_goodput_from_costs():
    out = gp.goodput_from_costs({"restart": 20.0, "torchft": 5.0}, mtbf=100.0, overhead={"restart": 0.1})
    assert out == {"restart": pytest.approx(0.7), "torchft": pytest.approx(0.95)}
    assert gp.goodput_from_costs({"x": 500.0}, mtbf=100.0)["x"] == 0.0


def test_account_splits_the_wall_time():
    out = gp.account({"wall": 10.0, "kept": 6.0, "recomputed": 1.0, "checkpoints": 0.5, "restarts": 2.0})
    assert out["goodput"] == pytest.approx(0.6) and out["seconds"]["other"] == pytest.approx(0.5)
    assert sum(out["shares"].values()) == pytest.approx(1.0)
    assert gp.model_matches(0.61, 0.6, 0.02) and not gp.model_matches(0.7, 0.6, 0.02)


def test_run_verdicts_flip():
    from labs.lab14_diloco import matches_torchft
    from labs.lab14_failures import same_losses, same_parameters

    assert same_losses([1.0, 2.0], [1.0, 2.0]).startswith("the same run")
    assert same_losses([1.0, 2.1], [1.0, 2.0]).startswith("NOT the uninterrupted run")
    assert same_parameters([[1.0, 2.0], [1.0, 2.0]]).startswith("all 2 groups hold identical")
    assert "DIFFER" in same_parameters([[1.0, 2.0], [1.0, 2.5]])
    assert matches_torchft([0.0, 1e-7]).startswith("your outer step is torchft's")
    assert "NOT torchft's" in matches_torchft([0.0, 0.3]) and "after step 1" in matches_torchft([0.0, 0.3])


def test_step_spread():
    assert step_spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert step_spread([1.0, 2.0, 3.0, 4.0, 5.0]) > 0.5


# ------------------------------------------------------------------------------ where each fits
def cluster(**changes) -> fit.Setting:
    base = fit.Setting(model_bytes=16e9, compute_s=1.0, groups=4, link_bytes_per_s=400e9 / 8,
                       failures=gp.Failures(per_day=0.01, delta=60.0, restart=600.0, heal=300.0, step=1.0),
                       sync_every=100, token_efficiency=0.9)
    return fit.Setting(**{**base.__dict__, **changes})


def test_fast_link_rare_failures_is_ddp_country():
    verdict = fit.best(fit.useful_share(cluster()))
    assert verdict.startswith("DDP/FSDP + restarts") or verdict.startswith("HSDP + torchft ~ DDP"), verdict


def test_fast_link_frequent_failures_is_torchft_country():
    shares = fit.useful_share(cluster(failures=gp.Failures(per_day=40, delta=60.0, restart=1800.0, heal=300.0, step=1.0)))
    assert fit.best(shares) == "HSDP + torchft", shares


def test_slow_link_is_diloco_country():
    shares = fit.useful_share(cluster(link_bytes_per_s=1e9 / 8))
    assert fit.best(shares) == "DiLoCo + torchft", shares
    assert fit.best(fit.useful_share(cluster(link_bytes_per_s=1e9 / 8, token_efficiency=0.001))) != "DiLoCo + torchft"


def test_fit_table_and_ties():
    rows = fit.fit_table(cluster(), {"fast": 400e9 / 8, "slow": 1e9 / 8}, [0.01, 40])
    assert [r["link between groups"] for r in rows] == ["fast", "slow"]
    assert rows[1]["40 failures/day"].startswith("DiLoCo")
    assert fit.best({"a": 1.0, "b": 0.97, "c": 0.1}) == "a ~ b"
    assert fit.best({"a": 0.0, "b": 0.0, "c": 0.0}).startswith("none")


def test_token_efficiency():
    assert fit.token_efficiency([4.0, 3.0, 2.0, 1.0], 3.0, 10) == pytest.approx(0.5)
    assert fit.token_efficiency([4.0, 3.0], 1.0, 10) == 1.0             # DDP never got there
    assert fit.token_efficiency([1.0, 0.5], 2.0, 10) == pytest.approx(0.5)


def test_comm_model_is_a_ring():
    s = cluster(groups=4, model_bytes=4e9, link_bytes_per_s=1e9)
    assert fit.comm_s(s) == pytest.approx(2 * 3 / 4 * 4.0)
    assert fit.comm_s(cluster(groups=1)) == 0.0
    assert math.isfinite(fit.useful_share(cluster(groups=1))["DiLoCo + torchft"])
