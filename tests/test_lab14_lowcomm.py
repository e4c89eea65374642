"""Tests of lab 14's low-communication runs (labs/lab14_lowcomm.py) and of the slowed link
(helpers/slow_link.py): in this process, the verdicts fed both ways, the fragments, the rounding
errors, the bf16 manager and the link's bad input; in one launch on 2 ranks (this file is also its
worker):

- DDP, local SGD, DiLoCo, streaming DiLoCo and bf16 DiLoCo over loopback (DDP and streaming
  DiLoCo over the slowed link too): the bytes each sends, counted per step, against what each
  algorithm must send (DDP: the model every step; DiLoCo: the model every H steps; streaming: one
  fragment every H/F steps, started tau steps early; bf16: half), the replicas holding the same global parameters after the run,
  DDP's run against one process on the global batch, and the slowed link's floor (a step cannot
  take less than its bytes over the link; streaming's overlap waits less than the link's time);
- the slowed link alone: a blocking all-reduce takes at least bytes / bandwidth, an asynchronous
  one overlaps with work done before its wait.

Run:  .venv/bin/python -m pytest tests/test_lab14_lowcomm.py -q
"""
from __future__ import annotations

import sys
import time

import pytest
import torch

from helpers.slow_link import slow_link
from labs import lab14_lowcomm as lowcomm_lab
from labs.lab14_restart import make_model, task_config
from tests.harness import launch_ranks

CFG = lowcomm_lab.Run.preset("smoke", steps=8, sync_every=4, delay=1)
STEPS, H, DELAY = CFG.steps, CFG.sync_every, CFG.delay


# ---------------------------------------------------------------------------------- in this process
def test_time_verdict_flips():
    assert "2.00x faster" in lowcomm_lab.time_verdict("DiLoCo", 1.0, "DDP", 2.0, noise=0.1)
    assert "2.00x slower" in lowcomm_lab.time_verdict("DiLoCo", 2.0, "DDP", 1.0, noise=0.1)
    assert "within the noise" in lowcomm_lab.time_verdict("DiLoCo", 1.0, "DDP", 1.05, noise=0.1)


def test_loss_verdict_flips():
    base = [3.0, 3.2, 2.9, 3.1]
    assert "lower than DDP's" in lowcomm_lab.loss_verdict("DiLoCo", [b - 0.2 for b in base], "DDP", base)
    assert "higher than DDP's" in lowcomm_lab.loss_verdict("DiLoCo", [b + 0.2 for b in base], "DDP", base)
    noisy = [b + d for b, d in zip(base, (0.1, -0.1, 0.12, -0.11))]
    assert "within the noise" in lowcomm_lab.loss_verdict("DiLoCo", noisy, "DDP", base)


def test_fragments_cover_the_model_once():
    model, _ = make_model(task_config(CFG))
    parts = lowcomm_lab.fragments(model, 2)
    ids = [id(p) for part in parts for p in part.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert all(len(list(part.parameters())) for part in parts)


def test_quantisation_error():
    x = torch.linspace(-1, 1, 1001)
    q = lowcomm_lab.quantisation_error(x)
    assert 0 < q["bf16"] < 1e-2 and 0 < q["int8"] < 1e-2
    assert lowcomm_lab.quantisation_error(torch.zeros(4))["int8"] == 0.0


def test_low_precision_manager_sends_bf16_and_lands_in_fp32():
    sent = []

    class Fake:
        _use_async_quorum = False

        def allreduce(self, tensor, **kwargs):
            sent.append(tensor.dtype)

            class Work:
                def wait(self, timeout=None):
                    tensor.mul_(2)
                    return True
            return Work()

    manager = lowcomm_lab.LowPrecisionManager(Fake(), torch.bfloat16)
    x = torch.tensor([1.0, 2.5])
    manager.allreduce(x).wait()
    assert sent == [torch.bfloat16] and x.dtype == torch.float32 and x.tolist() == [2.0, 5.0]
    assert manager._use_async_quorum is False and torch.equal(manager.sample, torch.tensor([1.0, 2.5]))


def test_slow_link_refuses_bad_input():
    with pytest.raises(ValueError, match="positive bandwidth"):
        with slow_link(0):
            pass
    with pytest.raises(ValueError, match="latency cannot be negative"):
        with slow_link(1e6, latency_s=-1):
            pass


# ---------------------------------------------------------------------------------- the launch
def worker() -> None:
    import torch.distributed as dist

    from helpers.dist import distributed
    from labs.lab14_restart import train_text

    with distributed() as ctx:
        torch.set_num_threads(1)
        # over the slowed link the two runs whose times the tests read (the bytes are the link's
        # business on loopback already; the notebook runs all five over both)
        out = lowcomm_lab.run(ctx, CFG, slow_methods=("DDP", "streaming DiLoCo"))
        # the slowed link alone: 1 MB all-reduces on 2 ranks (each rank sends 1 MB: a ring)
        x = torch.ones(250_000)
        with slow_link(20e6) as link:
            t = time.perf_counter()
            dist.all_reduce(x)
            blocking = time.perf_counter() - t
            t = time.perf_counter()
            work = dist.all_reduce(x, async_op=True)
            time.sleep(0.03)
            work.wait()
            overlapped = time.perf_counter() - t
        out["link test"] = {"blocking": blocking, "overlapped": overlapped, "calls": link.calls,
                            "sent": link.sent_bytes, "waited": link.waited_s}
        if ctx.rank == 0:    # one process on whole global batches
            from labs.lab12_model import batch_at

            config, data = task_config(CFG), train_text()
            model, optimizer = make_model(config)
            for step in range(STEPS):
                x, y = batch_at(data, step, config.batch, config.seq)
                lowcomm_lab.lm_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            out["reference_held_out"] = lowcomm_lab.held_out(model, config)
        ctx.report(out=out)


@pytest.fixture(scope="module")
def out():
    return launch_ranks(__file__, "worker", nproc=2, timeout=400, env={"DIST_TIMEOUT": "30"})[0]["out"]


def test_bytes_per_step_are_the_algorithms(out):
    """DDP sends the model every step; local SGD and DiLoCo every H steps; bf16 half of that."""
    model = out["config"]["model_bytes"]
    runs = out["fast"]
    assert runs["DDP"]["bytes_by_step"] == [model] * STEPS == out["slow"]["DDP"]["bytes_by_step"]
    expected = [model if (s + 1) % H == 0 else 0 for s in range(STEPS)]
    for name in ("local SGD", "DiLoCo"):
        assert runs[name]["bytes_by_step"] == expected, (name, runs[name]["bytes_by_step"])
    assert runs["DiLoCo, bf16 pseudo-gradients"]["bytes_by_step"] == [b // 2 for b in expected]


def test_streaming_sends_a_fragment_every_h_over_f_steps_started_tau_early(out):
    model, fragments = out["config"]["model_bytes"], out["config"]["fragments"]
    every = H // fragments
    sent = out["fast"]["streaming DiLoCo"]["bytes_by_step"]
    assert out["slow"]["streaming DiLoCo"]["bytes_by_step"] == sent, "the slowed link changed what was sent"
    busy = [s for s, b in enumerate(sent) if b]
    assert busy == [s for s in range(STEPS) if (s + 1 + DELAY) % every == 0], sent
    assert sum(sent) == model * STEPS // H and max(sent) < model      # one fragment at a time


def test_replicas_share_the_global_parameters(out):
    for link in ("fast", "slow"):
        for name, run in out[link].items():
            assert run["spread"] == 0.0, f"{link}, {name}: replicas differ by {run['spread']}"


def test_ddp_is_one_process_on_the_global_batch(out):
    """DDP's model after the run scores what one process's does on the same held-out batches, over
    either link."""
    for link in ("fast", "slow"):
        assert out[link]["DDP"]["held_out"] == pytest.approx(out["reference_held_out"], rel=1e-4), link


def test_slowed_link_sets_a_floor_and_streaming_overlaps(out):
    bandwidth = out["link_bytes_per_s"]
    slow = out["slow"]
    assert slow["DDP"]["step_s"] >= 0.95 * out["config"]["model_bytes"] / bandwidth
    assert slow["DDP"]["link_waited_s"] > 0
    stream = slow["streaming DiLoCo"]
    assert stream["link_waited_s"] < stream["link_imposed_s"], "the fragments' all-reduces overlapped nothing"
    for name, run in out["fast"].items():
        assert run["link_waited_s"] == 0.0 and run["link_imposed_s"] == 0.0, name


def test_link_alone(out):
    t = out["link test"]
    floor = 1e6 / 20e6              # 1 MB sent by each of 2 ranks over 20 MB/s
    assert t["calls"] == 2 and t["sent"] == pytest.approx(2e6)
    assert t["blocking"] >= 0.95 * floor
    assert t["overlapped"] >= 0.95 * floor and t["waited"] < 2 * floor


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker()
