"""Tests of lab 13's runs on 8 ranks, one launch (the instructor's solution throughout):

- the course's ring attention for grouped-query attention at global positions (zig-zag, and
  positions in any order) and Ulysses, against one process's SDPA in float64, outputs and
  gradients;
- every part of the notebook's full-size launch (labs/lab13_studies.py, its 8-rank meshes) at the
  smoke sizes: the 5-D run (dp_shard 2 x cp 2 x tp 2, ep = dp_shard x cp) and its pipelined
  variant (pp 2 x dp_shard 2 x cp 2) against one process within labs/lab13_train.py's
  tolerances, HSDP's bytes across the halves against plain FSDP's, the ring's and Ulysses' bytes
  on cp counted against the planner's formula, reshard_after_forward's all-gathers, the layout
  chooser's run (4 ranks: the public tests and the notebook's smoke run);
- the planner's count of every collective of a step per mesh dimension against the traffic
  instrument's (helpers.traffic.TrafficMeter), on the launch's layouts and two more (a pipeline
  with tp; resharding under a pipeline); on tp, the planner's all-reduces are a lower bound.

One launch of 8 ranks, not one of 4 and another of 8: on the course's 2-core machine a launch's
start and its ranks' imports (FSDP2 and DTensor bring torch._dynamo) cost as much as the work.

Run:  .venv/bin/python -m pytest tests/test_lab13_stack.py -q
"""
from __future__ import annotations

import sys

import pytest

from tests.harness import launch_ranks

NPROC = 8
EXTRA = {"pp 2 x cp 2 x tp 2": ({"pp": 2, "cp": 2, "tp": 2}, {}),
         "pp 2 x dp_shard 2 x tp 2, resharding": ({"pp": 2, "dp_shard": 2, "tp": 2}, {"reshard_after_forward": True})}


# ============================================================================ the worker
def ring_checks(ctx) -> dict:
    """gqa_ring_attention and Ulysses (ContextParallel) against SDPA on the whole sequence."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labs.lab13_context import ContextParallel, cp_positions

    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(0)
    out = {}
    for design, heads, kv in (("ring", 4, 2), ("ring", 4, 4), ("ulysses", 2 * n, n)):
        b, s, d = 2, 8 * n, 8
        q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (heads, kv, kv))
        dout = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        ref.backward(dout)
        for layout in ("zigzag", "shuffled"):
            pos = (cp_positions(s, n, r) if layout == "zigzag"
                   else torch.randperm(s, generator=torch.Generator().manual_seed(5))[r * s // n:(r + 1) * s // n])
            mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            got = ContextParallel(dist.group.WORLD, pos, design)(*mine)
            got.backward(dout[:, :, pos])
            errs = [(got - ref[:, :, pos]).abs().max().item()] + [
                (m.grad - f.grad[:, :, pos]).abs().max().item() for m, f in zip(mine, full)]
            out[f"{design}, {heads} heads / {kv} kv, {layout}"] = max(errs)
    return out


def worker() -> None:
    from helpers.dist import distributed
    from labs import lab13_studies as studies
    from labs.lab13_model import default_config
    from labs.lab13_train import check_run

    with distributed() as ctx:
        ctx.report(ring=ring_checks(ctx))
        ctx.report(studies=studies.run(ctx, studies.Run.preset("smoke", ranks=NPROC)))
        config = default_config("smoke")
        ctx.report(extra={name: check_run(ctx, sizes, config=config, steps=2, **options)
                          for name, (sizes, options) in EXTRA.items()})


@pytest.fixture(scope="module")
def res():
    return launch_ranks(__file__, "worker", nproc=NPROC, timeout=400, env={"DIST_TIMEOUT": "60"})


def parts(res, name):
    out = [res[r]["studies"][name] for r in range(NPROC)]
    assert all("unsolved" not in p for p in out), out[0]
    return out


# ============================================================================ the tests
def test_ring_and_ulysses_match_sdpa_at_global_positions(res):
    for rank in range(NPROC):
        for case, err in res[rank]["ring"].items():
            assert err < 1e-12, f"rank {rank}, {case}: off SDPA by {err:.2e}"


@pytest.mark.parametrize("name", ["composed", "pipelined"])
def test_composed_runs_match_one_process(res, name):
    from labs.lab13_train import agreement

    reports = parts(res, name)
    for what, v in agreement(reports).items():
        assert v["within"], f"{name}: {what} differs from one process by {v['worst']:.2e} (tolerance {v['tolerance']:g})"
    assert max(r["bias_moved"] for r in reports) > 0, "the biases never moved: the check of them would be empty"


def test_the_launch_exercises_its_axes(res):
    axes = res[0]["studies"]["axes"]
    assert {"cp", "tp"} <= set(axes["composed"]) and "pp" in axes["pipelined"]
    assert any(a.startswith("ep") for a in axes["composed"])


def test_hsdp_sends_less_across_the_halves(res):
    from labs.lab13_studies import hsdp_verdict

    v = hsdp_verdict({r: p for r, p in enumerate(parts(res, "hsdp"))})
    assert v["outcome"] == "less", v


def test_cp_bytes_counted_equal_the_planner(res):
    rows = parts(res, "cp")[0]
    for row in rows:
        assert row["ok"] and row["sent"] == row["planned"], row
    from labs.lab13_studies import gqa_effect

    effect = gqa_effect(rows)
    assert effect["ring"] == pytest.approx(2.0) and 1 < effect["ulysses"] < 2


def test_resharding_under_a_pipeline_gathers_more(res):
    from labs.lab13_studies import reshard_verdict

    v = reshard_verdict({r: p for r, p in enumerate(parts(res, "reshard"))})
    assert v["fewer_gathers"] and v["holds_more_between"], v


def test_the_chooser_ran_its_top_two(res):
    from labs.lab13_chooser import ranking_verdict

    chosen = parts(res, "chooser")[0]
    assert len(chosen["top"]) == 2 and all(len(t) >= 2 for t in chosen["measured"].values())
    assert ranking_verdict(chosen["top"], chosen["measured"])["outcome"] in ("held", "reversed", "noise")


def reports_with_traffic(res):
    runs = {name: parts(res, name)[0] for name in ("composed", "pipelined")}
    runs.update({f"hsdp: {k}": {**v, "sizes": v["sizes"]} for k, v in parts(res, "hsdp")[0].items()})
    runs.update({name: res[0]["extra"][name] for name in EXTRA})
    return runs


@pytest.mark.parametrize("name", ["composed", "pipelined", "hsdp: hsdp", "hsdp: flat", *EXTRA])
def test_planner_counts_every_collective(res, name):
    from labs.lab13_model import default_config
    from labs.lab13_planner import Layout, MoEShape, per_dimension, step_calls

    run = reports_with_traffic(res)[name]
    sizes = {d: run["sizes"].get(d, 1) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    options = EXTRA.get(name, ({}, {}))[1]
    layout = Layout(**sizes)
    planned = per_dimension(step_calls(layout, MoEShape.from_config(default_config("smoke")), **options), layout.sizes)
    for dim in set(planned) | set(run["traffic"]):
        measured = {k: v for k, v in run["traffic"].get(dim, {}).get("calls", {}).items() if k != "recv"}
        expected = dict(planned.get(dim, {}).get("calls", {}))
        if dim == "tp":   # TrafficMeter sees more of DTensor's own all-reduces (loss_parallel's, the
            # norms') than the planner counts: a lower bound there, an open question (see the report)
            more, counted = measured.pop("all_reduce", 0), expected.pop("all_reduce", 0)
            assert more >= counted, f"{name}, tp: {more} all-reduces measured, the planner counts {counted}"
        assert measured == expected, f"{name}, {dim}: measured {measured}, the planner counts {expected}"


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    worker()
