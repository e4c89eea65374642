"""Tests of lab 07's non-exercise parts: formats and where they round to zero, tf32 emulation and
its switches (the fp32_precision API of torch >= 2.9), running sums in low precision, autocast
listing, the precision runs, GradScaler in practice (clipping, checkpoints), memory counting and
the measured peak with checkpointing, gradient accumulation, swapping against a budget, and the
five labs on 2 ranks (one launch: this module is also the torchrun worker, see the bottom).

Tolerances: swapped / accumulated / data-parallel fp32 training vs the single-process reference
1e-6 absolute on parameters (only the summation order differs); everything else is exact.
"""
import copy
import math
import sys

import pytest
import torch
import torch.distributed as dist

from helpers.dist import distributed
from labs import lab07_amp as amp
from labs import lab07_formats as fm
from labs import lab07_low_precision as lp
from labs import lab07_memory as mem
from labs import lab07_swapping as swap
from tests.harness import launch_ranks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread avoids thread-synchronisation overhead (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# formats and tf32 emulation
# --------------------------------------------------------------------------------------------
def test_formats_table_has_the_known_layouts():
    rows = {r["format"]: r for r in fm.formats_table()}
    layout = {name: (r["bits"], r["exponent"], r["mantissa"]) for name, r in rows.items()}
    assert layout == {"fp32": (32, 8, 23), "tf32": (19, 8, 10), "fp16": (16, 5, 10),
                      "bf16": (16, 8, 7), "fp8 e4m3": (8, 4, 3), "fp8 e5m2": (8, 5, 2)}
    assert rows["fp16"]["max"] == 65504.0 and rows["fp8 e4m3"]["max"] == 448.0
    assert rows["fp16"]["smallest subnormal"] == 2.0 ** -24
    assert rows["tf32"]["max"] == (2 - 2 ** -10) * 2.0 ** 127
    smallest_normal = {rows[k]["smallest normal"] for k in ("tf32", "fp32", "bf16")}
    assert smallest_normal == {2.0 ** -126}
    # the smallest subnormal really is the last representable step above zero
    for name in ("fp16", "bf16"):
        tiny = torch.tensor(rows[name]["smallest subnormal"], dtype=torch.float64)
        dtype = fm.FORMATS[name]
        assert tiny.to(dtype).item() == tiny.item() and (tiny / 4).to(dtype).item() == 0.0


def test_values_at_or_below_half_the_smallest_subnormal_round_to_zero():
    """Not "below 2^-24" for fp16: 2^-25 is a tie and rounds to the even neighbour, 0; anything
    above it rounds up to the smallest subnormal 2^-24."""
    assert fm.underflow_threshold(torch.float16) == 2.0 ** -25
    assert fm.underflow_threshold(torch.bfloat16) == 2.0 ** -134
    rows = {r["format"]: r for r in fm.formats_table()}
    for name, dtype in fm.FORMATS.items():
        if dtype is None:
            continue
        zero, smallest = fm.underflow_threshold(dtype), rows[name]["smallest subnormal"]
        assert rows[name]["zero at or below"] == zero == smallest / 2
        cast = lambda v: torch.tensor(v, dtype=torch.float64).to(torch.float32).to(dtype).item()
        assert cast(zero) == 0.0 and cast(zero * 0.99) == 0.0, name
        assert cast(zero * 1.01) == smallest, name   # just above the tie: up to the subnormal


def test_tf32_switches_use_the_fp32_precision_api():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert fm.has_fp32_precision_api() == ((major, minor) >= (2, 9))
    switches = fm.tf32_switches()
    if fm.has_fp32_precision_api():
        assert set(switches) == {"torch.backends.fp32_precision",
                                 "torch.backends.cuda.matmul.fp32_precision",
                                 "torch.backends.cudnn.conv.fp32_precision"}
        before = torch.backends.cuda.matmul.fp32_precision
        with fm.matmul_tf32(True):
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        with fm.matmul_tf32(False):
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == before   # restored
    else:
        assert "torch.backends.cuda.matmul.allow_tf32" in switches


def test_running_sums_stop_growing_in_low_precision():
    assert fm.stall_value(1.0, torch.bfloat16) == 256.0     # 2^(7 + 1)
    assert fm.stall_value(1.0, torch.float16) == 2048.0     # 2^(10 + 1)
    sums = fm.running_sum(1.0, 600, torch.bfloat16)
    assert sums[255] == 256.0 and sums[-1] == 256.0
    assert fm.running_sum(1.0, 600, torch.float32)[-1] == 600.0
    # torch's own reduction accumulates in fp32, then rounds the result once
    assert torch.ones(600, dtype=torch.bfloat16).sum().item() == torch.tensor(600.0).bfloat16().item()


def test_round_mantissa_equals_the_bf16_and_fp16_casts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-30, 30, (50_000,), generator=g).float())
    ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130, 3e38])
    x = torch.cat([x, ties])
    assert torch.equal(fm.round_mantissa(x, 7), x.bfloat16().float())
    in_fp16_range = x[(x.abs() > 2.0 ** -14) & (x.abs() < 60000)]
    assert torch.equal(fm.round_mantissa(in_fp16_range, 10), in_fp16_range.half().float())
    assert torch.equal(fm.round_mantissa(x, 23), x)


def test_round_mantissa_edge_cases():
    x = torch.tensor([1 + 2.0 ** -11, 1 + 2.0 ** -10 + 2.0 ** -11, 2 - 2.0 ** -23, math.inf, -math.inf])
    out = fm.round_mantissa(x, 10)
    assert out[:4].tolist() == [1.0, 1 + 2.0 ** -9, 2.0, math.inf]  # ties to even; carry into exponent
    assert out[4].item() == -math.inf
    assert fm.round_mantissa(torch.tensor([math.nan]), 10).isnan().all()
    with pytest.raises(ValueError):
        fm.round_mantissa(torch.ones(2, dtype=torch.float64), 10)


def test_matmul_error_grows_as_the_mantissa_shrinks():
    err = {r["inputs"]: r["relative error"] for r in fm.matmul_errors(64)}
    assert err["fp32"] < err["tf32 (emulated)"] < err["bf16 (emulated)"]
    assert 2.0 ** -14 < err["tf32 (emulated)"] < 2.0 ** -9  # about one 10-bit rounding


def test_autocast_listing_separates_matmuls_from_the_rest():
    rows = {r["op"]: r for r in fm.autocast_output_dtypes("cpu", torch.bfloat16)}
    assert rows["linear"]["fp32 input"] == rows["matmul"]["fp32 input"] == "bfloat16"
    assert rows["add"]["fp32 input"] == "float32" and rows["add"]["bfloat16 input"] == "bfloat16"
    assert rows["mse_loss"]["bfloat16 input"] == "float32"  # losses are computed in fp32
    assert rows["x + fp32 tensor"]["bfloat16 input"] == "float32"  # type promotion: widest wins
    with pytest.raises(ValueError):
        fm.matmul_speed(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# precision runs and gradient underflow
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def precision_runs():
    return {p: lp.train_precision(p, steps=8, batch_size=64) for p in lp.PRECISIONS}


def test_runs_start_from_the_same_model_and_data(precision_runs):
    first = {p: r["losses"][0] for p, r in precision_runs.items()}
    assert first["fp16"] == first["fp16 + loss scaling"]
    assert abs(first["bf16"] - first["fp32"]) < 0.02 * first["fp32"]
    assert precision_runs["fp32"]["losses"][-1] < first["fp32"]


def test_fp16_without_scaling_loses_gradients_and_scaling_restores_them(precision_runs):
    assert min(precision_runs["fp16"]["zero_fraction"]) > 0.01
    assert max(precision_runs["fp16 + loss scaling"]["zero_fraction"]) == 0.0
    assert max(precision_runs["fp32"]["zero_fraction"]) == 0.0
    assert precision_runs["fp16 + loss scaling"]["scales"][0] == 2.0 ** 16


def test_gradient_exponents_and_zero_fraction(precision_runs):
    model = precision_runs["fp32"]["model"]
    batch = lp.make_signals(64, seed=5)
    exps = lp.gradient_exponents(model, batch)
    for key in ("activations", "weights"):
        assert exps[key].numel() > 0 and torch.equal(exps[key], exps[key].floor())
    assert (exps["weights"] < -24).any()  # some fp32 gradients lie below fp16's smallest subnormal
    assert lp.zero_gradient_fraction(model, batch, "fp32") == 0.0
    unscaled = lp.zero_gradient_fraction(model, batch, "fp16")
    assert unscaled > 0.01 and lp.zero_gradient_fraction(model, batch, "fp16", 2.0 ** 16) < unscaled / 10
    with pytest.raises(ValueError):
        lp.autocast_dtype("fp64")


# --------------------------------------------------------------------------------------------
# GradScaler in practice
# --------------------------------------------------------------------------------------------
def test_clipping_the_scaled_gradients_clips_them_s_times_too_hard():
    runs = amp.clipping_experiment(steps=6)
    right, wrong = runs["unscale_ then clip"], runs["clip scaled gradients"]
    assert right["scale"] == wrong["scale"] == 2.0 ** 16
    # first step, same weights: clip_grad_norm_ saw S times the true norm
    assert wrong["norms"][0] == pytest.approx(2.0 ** 16 * right["norms"][0], rel=1e-3)
    assert right["losses"][0] == wrong["losses"][0]
    assert right["losses"][-1] < wrong["losses"][-1]   # the clipped-to-nothing run lags


def test_a_checkpoint_needs_the_scalers_state():
    result = amp.resume_experiment(steps=16, stop_at=8)
    runs = result["runs"]
    full = runs["uninterrupted"]
    assert full["skipped"][:3] == [0, 1, 2]         # large signals: the scale backs off first
    assert full["scales"][8] < 2.0 ** 16
    resumed = runs["resumed with the scaler's state"]
    assert resumed["max_param_diff"] == 0.0        # bit for bit the uninterrupted run
    assert resumed["scales"] == full["scales"][8:]
    assert resumed["skipped"] == [k for k in full["skipped"] if k >= 8]
    fresh = runs["resumed without it"]
    assert fresh["scales"][0] == 2.0 ** 16 and fresh["skipped"][0] == 8   # overflows again
    assert fresh["max_param_diff"] > 0.0
    state = torch.load(__import__("io").BytesIO(amp.checkpoint_bytes(
        torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        torch.amp.GradScaler("cpu"))))
    assert set(state) == {"model", "optimizer", "scaler"} and "scale" in state["scaler"]


# --------------------------------------------------------------------------------------------
# memory: counting, checkpointing, accumulation, swapping
# --------------------------------------------------------------------------------------------
WIDTH, DEPTH, ROWS = 32, 4, 16


def test_memory_counts_match_the_formulas():
    model = mem.make_blocks(WIDTH, DEPTH)
    x, y = mem.make_regression_data(ROWS, WIDTH)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    fp32 = mem.count_training_memory(model, x, y, "fp32")
    assert fp32["parameters"] == fp32["gradients"] == 4 * n_params
    assert fp32["optimizer state"] == 8 * n_params + 4 * n_tensors  # exp_avg, exp_avg_sq + step
    # per block: its input (rows, w), GELU's input and the down-projection's input (rows, 4w);
    # then the output and the target for the loss
    assert fp32["activations"] == 4 * ROWS * WIDTH * (9 * DEPTH + 2)
    bf16 = mem.count_training_memory(model, x, y, "bf16")
    assert bf16["parameters"] == 2 * n_params and bf16["gradients"] == 2 * n_params
    mixed = mem.count_training_memory(model, x, y, "bf16 autocast")
    assert mixed["parameters"] == fp32["parameters"] and mixed["optimizer state"] == fp32["optimizer state"]
    parts = ("parameters", "gradients", "optimizer state", "activations")
    assert fp32["total"] == sum(fp32[k] for k in parts)
    assert fp32["weight copies (in activations)"] == 0
    # autocast saves a bf16 copy of every weight whose layer must pass a gradient to its input:
    # all but the first layer's (the batch needs no gradient)
    first = model[0].up.weight.numel()
    assert mixed["weight copies (in activations)"] == 2 * (sum(
        p.numel() for name, p in model.named_parameters() if name.endswith("weight")) - first)


def test_checkpointing_keeps_only_the_block_inputs():
    model = mem.make_blocks(WIDTH, DEPTH)
    x, y = mem.make_regression_data(ROWS, WIDTH)
    ckpt = mem.count_training_memory(model, x, y, "fp32", use_checkpoint=True)
    assert ckpt["activations"] == 4 * ROWS * WIDTH * (DEPTH + 2)
    # and it computes the same gradients
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    torch.nn.functional.mse_loss(mem.run_blocks(a, x), y).backward()
    torch.nn.functional.mse_loss(mem.run_blocks(b, x, use_checkpoint=True), y).backward()
    assert all(torch.allclose(p.grad, q.grad, atol=1e-7) for p, q in zip(a.parameters(), b.parameters()))
    c = copy.deepcopy(model)   # sqrt(L) segments too
    torch.nn.functional.mse_loss(mem.run_blocks(c, x, segments=2), y).backward()
    assert all(torch.allclose(p.grad, q.grad, atol=1e-7) for p, q in zip(a.parameters(), c.parameters()))


@pytest.fixture(scope="module")
def checkpoint_sweep():
    return {(r["depth"], r["mode"]): r for r in mem.checkpointing_sweep([4, 16, 64], 32, 32)}


def test_measured_peak_without_checkpointing_is_the_counted_activations(checkpoint_sweep):
    unit = 4 * 32 * 32     # one block input, (rows, width) floats
    for depth in (4, 16, 64):
        r = checkpoint_sweep[depth, "none"]
        counted = unit * (9 * depth + 1)    # SavedTensorBytes' count (test above), less the
        assert counted <= r["after forward"] <= counted + 8 * unit, (depth, r)  # target: it existed
        assert r["peak backward"] >= r["after forward"]


def test_per_block_checkpointing_is_linear_and_sqrt_segments_sublinear(checkpoint_sweep):
    peak = {key: r["peak backward"] for key, r in checkpoint_sweep.items()}
    for mode in ("per block", "sqrt(L) segments"):
        for depth in (4, 16, 64):
            assert peak[depth, mode] < peak[depth, "none"], (depth, mode)
            r = checkpoint_sweep[depth, mode]   # recomputation happens during backward
            assert r["peak backward"] > r["after forward"], (depth, mode)
    growth = {mode: peak[64, mode] / peak[16, mode] for mode in mem.CHECKPOINT_MODES}
    # 4x the depth: ~4x without checkpointing; per block L + 17 block inputs (33 -> 81, heading
    # for 4x); sqrt(L) segments ~sqrt(4) = 2x
    assert growth["none"] > 3.5 and growth["per block"] > 2.3 and growth["sqrt(L) segments"] < 2.0, growth
    assert [mem.sqrt_segments(d) for d in (4, 16, 64, 256)] == [2, 4, 8, 16]


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_gradient_accumulation_equals_the_large_batch(micro_batches):
    model = mem.make_blocks(WIDTH, 2)
    x, y = mem.make_regression_data(32, WIDTH)  # 3 micro-batches: 11 + 11 + 10 rows
    big, small = copy.deepcopy(model), copy.deepcopy(model)
    loss_big = mem.accumulate_gradients(big, x, y, 1)
    loss_small = mem.accumulate_gradients(small, x, y, micro_batches)
    assert abs(loss_big - loss_small) < 1e-6
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6)


SWAP_WIDTH, SWAP_DEPTH = 64, 8


def _swap_setup(steps=3, rows=16):
    x, y = mem.make_regression_data(rows * steps, SWAP_WIDTH)
    return mem.make_blocks(SWAP_WIDTH, SWAP_DEPTH), list(zip(x.split(rows), y.split(rows)))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_swapped_training_equals_plain_training_within_the_budget(micro_batches):
    model, batches = _swap_setup()
    reference = copy.deepcopy(model)
    budget = swap.swap_budget(model, SWAP_DEPTH, 16 // micro_batches)
    assert budget < swap.model_bytes(model)  # the model does not fit
    device = swap.BudgetDevice(torch.device("cpu"), budget)
    losses = swap.train_swapped(model, batches, device, SWAP_DEPTH, micro_batches)
    ref_losses = swap.train_plain(reference, batches)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert 0 < device.peak <= budget and device.resident == 0  # nothing left behind
    # per micro-batch: every part's weights twice (forward, then backward), except the last part,
    # which runs forward and backward in one visit; plus the micro-batch's inputs and targets
    weights = micro_batches * swap.model_bytes(model) * (2 * SWAP_DEPTH - 1) // SWAP_DEPTH
    assert device.bytes_copied_in == len(batches) * (weights + 2 * 4 * 16 * SWAP_WIDTH)


def test_at_most_one_part_is_resident_and_the_budget_is_enforced():
    model, batches = _swap_setup(steps=1)
    device = swap.BudgetDevice(torch.device("cpu"), 10 ** 9)
    swap.train_swapped(model, batches, device, 2)
    resident_parts, most = set(), 0
    for event, _ in device.timeline:
        if event.endswith("weights"):
            part = event.split()[2]
            (resident_parts.add if event.startswith("+") else resident_parts.discard)(part)
            most = max(most, len(resident_parts))
    assert most == 1
    tight = swap.BudgetDevice(torch.device("cpu"), swap.model_bytes(model) // 4)
    with pytest.raises(swap.OutOfBudget):
        swap.train_swapped(mem.make_blocks(SWAP_WIDTH, SWAP_DEPTH), batches, tight, 2)  # half per part


# --------------------------------------------------------------------------------------------
# the labs on 2 ranks (one launch)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks():
    return launch_ranks(__file__, "labs", nproc=2, timeout=240, env={"COURSE_SMOKE": "1"})


def test_fp32_data_parallel_equals_one_process(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["fp32_dp_vs_single_max_diff"] <= 1e-6


def test_bf16_all_reduce_halves_the_bytes_and_adds_a_small_error(two_ranks):
    runs = two_ranks[0]["runs"]
    fp32, bf16_fp32, bf16_bf16 = (runs[k] for k in runs)
    assert bf16_bf16["bytes_per_all_reduce"] * 2 == bf16_fp32["bytes_per_all_reduce"]
    assert max(fp32["comm_errors"]) == 0.0 and max(bf16_fp32["comm_errors"]) == 0.0
    assert 0.0 < max(bf16_bf16["comm_errors"]) < 2.0 ** -6
    assert bf16_fp32["bf16_exact_fraction"] > 0.9  # bf16 matmuls make bf16-valued gradients
    for label, run in runs.items():  # every rank saw the same averaged gradients and losses
        other = two_ranks[1]["runs"][label]
        assert run["losses"] == other["losses"] and run["comm_errors"] == other["comm_errors"]


def test_bf16_all_reduce_rounds_the_sum_to_bf16(two_ranks):
    assert two_ranks[0]["bf16_mean_vs_rounded_sum"] == 0.0
    assert two_ranks[0]["bf16_mean_vs_fp32_mean"] > 0.0


def test_swapped_data_parallel_equals_plain_training_within_budget(two_ranks):
    for rank in (0, 1):
        r = two_ranks[rank]
        assert r["max_param_diff"] <= 1e-6
        assert r["peak_bytes"] <= r["budget_bytes"] < r["model_bytes"]
    assert two_ranks[0]["losses"] != two_ranks[1]["losses"]  # each rank had its own rows


def test_formats_lab_reports(two_ranks):
    assert [r["format"] for r in two_ranks[0]["formats"]] == list(fm.FORMATS)
    assert two_ranks[0]["matmul_speed"] is None or len(two_ranks[0]["matmul_speed"]) == 3
    assert two_ranks[0]["running_sum_stalls"] == {"bfloat16": 256.0, "float16": 2048.0}


def test_memory_and_amp_labs_report(two_ranks):
    for rank in (0, 1):
        r = two_ranks[rank]
        assert set(r["counts"]) == set(mem.MEMORY_PRECISIONS)
        assert {row["mode"] for row in r["checkpointing"]} == set(mem.CHECKPOINT_MODES)
        assert r["resume"]["runs"]["resumed with the scaler's state"]["max_param_diff"] == 0.0
        assert set(r["clipping"]) == {"unscale_ then clip", "clip scaled gradients"}


def _worker(case: str) -> None:
    with distributed() as ctx:
        if case != "labs":
            raise ValueError(case)
        fm.run(ctx, fm.Run.preset())
        lp.run(ctx, lp.Run.preset())
        mem.run(ctx, mem.Run.preset())
        swap.run(ctx, swap.Run.preset())
        amp.run(ctx, amp.Run.preset())
        g = torch.Generator().manual_seed(100 + ctx.rank)
        local = torch.randn(4096, generator=g).to(ctx.device)
        mean_bf16 = lp.all_reduce_mean(local, torch.bfloat16, ctx.world_size)
        mean_fp32 = lp.all_reduce_mean(local, torch.float32, ctx.world_size)
        parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
        dist.all_gather(parts, local)
        rounded_sum = torch.zeros_like(local, dtype=torch.bfloat16)
        for part in parts:  # the wire adds bf16 values (in fp32) and rounds the sum to bf16
            rounded_sum = (rounded_sum.float() + part.bfloat16().float()).bfloat16()
        expected = rounded_sum.float() / ctx.world_size
        ctx.report(bf16_mean_vs_rounded_sum=(mean_bf16 - expected).abs().max().item(),
                   bf16_mean_vs_fp32_mean=(mean_bf16 - mean_fp32).abs().max().item())


if __name__ == "__main__":
    _worker(sys.argv[1])
