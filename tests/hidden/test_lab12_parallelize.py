"""Hidden tests of lab 12's exercises, `parallelize` and `clip_grad_norm_`
(labs/lab12_parallelize.py).

Stricter than the public ones: other meshes of the 4 ranks (tensor parallelism alone over 4 ranks,
FSDP alone over 4, a pipeline of 2 stages over 2 FSDP replicas, a pipeline of 4 stages of one
block each, tp 2 on a pipeline with whole logits), a wider model (8 heads, 3 blocks, an MLP width
that is not 4h) with checkpointing, bf16 parameters and whole logits at once; every case checked
for everything: what each rank holds, the FSDP units, what the norms see, the logits, the
collectives of a step by mesh dimension (the tp group's counted against what sequence parallelism
needs), the FSDP units whole at once during a step, and training against one process. Clipping on
meshes where a stage holds no parameter at all, or nothing needs clipping; a wrong norm is named by
the misreading it matches.

One launch on 4 ranks; this file is also its worker. The case runners are the public tests'
(`run_case`, `clip_case`: the same measurements and comparisons).
"""
from __future__ import annotations

import sys

import pytest

from helpers.notice import stub_message
from labs.lab12_parallelize import clip_grad_norm_, parallelize
from tests.harness import launch_ranks
from tests.public.test_lab12_parallelize import (BF16_LOSS_RTOL, LOSS_RTOL, PARAM_ATOL, case, clip,
                                                 fsdp_units_problem, kept_next_to, norm_mistake,
                                                 not_in_bf16, run_worker, scaling_problem,
                                                 tp_traffic_problem, vocabulary_problem,
                                                 whole_units_problem)

NPROC = 4
WIDER = {"dim": 64, "heads": 8, "layers": 3, "ffn": 96}
CASES = {
    "tp4": ((1, 1, 4), {}),
    "dp4": ((1, 4, 1), {}),
    "pp2 x dp2": ((2, 2, 1), {}),
    "pp4": ((4, 1, 1), {"config": {"layers": 4}, "microbatches": 4}),
    "pp2 x tp2, whole logits": ((2, 1, 2), {"config": {"layers": 4}, "loss_parallel": False}),
    "wider": ((1, 2, 2), {"config": WIDER}),
    "wider, all options": ((1, 2, 2), {"config": WIDER, "activation_checkpointing": True, "bf16": True,
                                       "loss_parallel": False}),
}
CLIP_CASES = {
    "tp4": ((1, 1, 4), 0.1, (), 1),
    "dp4": ((1, 4, 1), 0.1, (), 2),
    "pp4": ((4, 1, 1), 0.3, (), 3),              # stages 2 and 3 hold no parameter
    "pp2 x dp2, not clipped": ((2, 2, 1), 5.0, (), 4),
    "pp2 x tp2, stage 0 without gradients": ((2, 1, 2), 0.05, (0,), 5),
}


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while both exercises are still stubs."""
    both = [parallelize, clip_grad_norm_]
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=280, env={"DIST_TIMEOUT": "30"},
                        needs=both if all(stub_message(f) for f in both) else [])


def shape(name: str) -> tuple[int, int, int]:
    return CASES[name][0]


# ------------------------------------------------------------------------------ parallelize
@pytest.mark.exercise("parallelize")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_what_each_rank_holds(results, name):
    """Every parameter is a DTensor split over tp, then over dp only: 1/(dp tp) of each matrix, 1/dp of each norm."""
    _, dp, tp = shape(name)
    for rep in case(results, name, trained=False):
        allowed = set(rep["dp_tp_ranks"])
        for param, e in rep["params"].items():
            assert e["dtensor"] and "dp" in e["dims"] and set(e["dims"]) <= {"dp", "tp"}, (
                f"rank {rep['rank']} ({name}): {param} on {e['dims']} ({e['placements']})")
            assert set(e["mesh_ranks"]) <= allowed, (
                f"rank {rep['rank']} ({name}): {param} spread over {e['mesh_ranks']}, outside {sorted(allowed)}")
            share = dp if param.endswith("norm.weight") else dp * tp
            assert e["local"] * share == e["global"], (
                f"rank {rep['rank']} ({name}): holds {e['local']} of {param}'s {e['global']} elements, "
                f"expected 1/{share}")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_units(results, name):
    """Every block of the stage, as model.layers holds it, and the stage itself are FSDP units."""
    for rep in case(results, name, trained=False):
        problem = fsdp_units_problem(rep, name)
        assert not problem, problem


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", [n for n in CASES if shape(n)[2] > 1])
def test_vocabulary_parallel(results, name):
    """The embedding and the output layer are split over the vocabulary on tp."""
    for rep in case(results, name, trained=False):
        problem = vocabulary_problem(rep, name)
        assert not problem, problem


@pytest.mark.exercise("parallelize")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", [n for n in CASES if shape(n)[2] > 1])
def test_sequence_parallel_traffic(results, name):
    """The tp group's all-gathers and reduce-scatters in a forward and a step, counted, are what sequence parallelism needs."""
    for rep in case(results, name):
        problem = tp_traffic_problem(rep, name)
        assert not problem, problem


@pytest.mark.exercise("parallelize")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", [n for n in CASES if shape(n)[0] == 1 and shape(n)[1] > 1])
def test_blocks_resharded_after_forward(results, name):
    """During a step at most the root and one block are whole at once (measured)."""
    for rep in case(results, name):
        problem = whole_units_problem(rep, name)
        assert not problem, problem


@pytest.mark.exercise("parallelize")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_norm_inputs(results, name):
    """Each norm sees its sequence shard (b, t / tp, dim) under tensor parallelism, the whole sequence without it."""
    tp = shape(name)[2]
    for rep in case(results, name):
        assert rep["norm_inputs"], f"rank {rep['rank']} ({name}): no norm was called"
        for norm, seen in rep["norm_inputs"].items():
            assert seen[1] * tp == rep["seq"], (
                f"rank {rep['rank']} ({name}): {norm} saw {seen}, expected {rep['seq'] // tp} positions")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", [n for n in CASES if shape(n)[0] == 1])
def test_logits(results, name):
    """Logits split over the vocabulary with loss_parallel (tp > 1), whole and plain with loss_parallel=False."""
    options, tp = CASES[name][1], shape(name)[2]
    for rep in case(results, name):
        logits = rep["logits"]
        assert logits["global_shape"][-1] == 256, f"rank {rep['rank']} ({name}): logits {logits}"
        if options.get("loss_parallel", True) and tp > 1:
            assert logits["dtensor"] and logits["placements"] == ["Shard(dim=2)"], (
                f"rank {rep['rank']} ({name}): logits {logits}, expected a DTensor split over the vocabulary")
        elif not options.get("loss_parallel", True):
            assert not logits["dtensor"] and logits["local_shape"][-1] == 256, (
                f"rank {rep['rank']} ({name}): logits {logits}, expected whole plain logits")


@pytest.mark.exercise("parallelize")
@pytest.mark.points(3)
@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_one_process(results, name):
    """Losses (and, in float32, parameters) after the steps equal one process's training of the whole model."""
    bf16 = CASES[name][1].get("bf16", False)
    for rep in case(results, name):
        rtol = BF16_LOSS_RTOL if bf16 else LOSS_RTOL
        for step, (got, want) in enumerate(zip(rep["losses"], rep["reference_losses"])):
            assert got == pytest.approx(want, rel=rtol), (
                f"rank {rep['rank']} ({name}): step {step} loss {got:.6f}, one process {want:.6f}")
        if not bf16:
            assert rep["param_diff"] < PARAM_ATOL, (
                f"rank {rep['rank']} ({name}): parameters differ by {rep['param_diff']:.2e}")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_collectives_by_dimension(results, name):
    """A step's collectives run on the dp, tp and pp groups only, FSDP's on dp and the activations' on tp."""
    pp, dp, tp = shape(name)
    for rep in case(results, name):
        traffic = rep["traffic"]
        stray = {d: t["calls"] for d, t in traffic.items() if d not in ("dp", "tp", "pp")}
        assert not stray, f"rank {rep['rank']} ({name}): collectives outside the mesh's groups: {stray}"
        calls = {d: traffic.get(d, {}).get("calls", {}) for d in ("dp", "tp")}
        if dp > 1:
            assert calls["dp"].get("all_gather", 0) and calls["dp"].get("reduce_scatter", 0), (
                f"rank {rep['rank']} ({name}): dp group made {calls['dp']}")
        if tp > 1:
            assert calls["tp"].get("all_gather", 0) and calls["tp"].get("reduce_scatter", 0), (
                f"rank {rep['rank']} ({name}): tp group made {calls['tp']}")


@pytest.mark.exercise("parallelize")
def test_options_together(results):
    """Checkpointing with bf16 parameters: far fewer bytes kept for the backward, bf16 compute."""
    for rep, plain in kept_next_to(results, "wider, all options", "wider"):
        # bf16 alone halves what is kept; checkpointing keeps only the blocks' inputs
        assert rep["saved_bytes"] < 0.25 * plain, (
            f"rank {rep['rank']}: kept {rep['saved_bytes']} bytes for the backward, {plain} without the options")
        assert not not_in_bf16(rep), f"rank {rep['rank']}: layers computed with {not_in_bf16(rep)}"


# --------------------------------------------------------------------------- clip_grad_norm_
@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CLIP_CASES))
def test_clip_norm_and_gradients(results, name):
    """The returned norm is the whole model's on every rank, and every gradient is scaled as one process scales it."""
    for rep in clip(results, name):
        r = rep["returned"]
        assert not r["dtensor"] and r["shape"] == [] and r["dtype"] == "torch.float32", (
            f"rank {rep['rank']} ({name}): returned {r}")
        assert rep["total"] == pytest.approx(rep["norm"], rel=1e-5), (
            f"rank {rep['rank']} (stage {rep['pp_rank']}, {name}): norm {rep['total']:.6f}, expected "
            f"{rep['norm']:.6f}.{norm_mistake(rep, rep['total'])}")
        for param, error in rep["grad_errors"].items():
            assert error <= 1e-5 * rep["scale"], scaling_problem(rep, name, param, error)


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    run_worker(CASES, CLIP_CASES)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
