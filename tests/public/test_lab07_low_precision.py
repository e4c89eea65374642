"""Public tests of the lab 07 exercise: LossScaler (labs/lab07_low_precision.py).

Run:  ./run.sh check 07

Each test runs your LossScaler and torch.amp.GradScaler("cpu") side by side on identical models
and compares, step by step: the scale, whether optimizer.step() ran (seen by a hook on the
optimizer), and the parameters after the step. Scales here are powers of two, so scaling and
unscaling are exact and the parameters must be bit-for-bit equal.
"""
import pytest
import torch

from labs.lab07_low_precision import LossScaler, scaler_trace

pytestmark = pytest.mark.exercise("LossScaler")


def both(steps, **kwargs):
    """(yours, GradScaler's) traces of the same run; kwargs: scaler settings and planted steps."""
    planted = {k: kwargs.pop(k) for k in ("overflow_steps", "nan_steps") if k in kwargs}
    ours = scaler_trace(LossScaler(**kwargs), steps=steps, **planted)
    torch_ = scaler_trace(torch.amp.GradScaler("cpu", **kwargs), steps=steps, **planted)
    return ours, torch_


def assert_same(ours, ref):
    if ours["scales"] != ref["scales"]:
        k = next(i for i, (a, b) in enumerate(zip(ours["scales"], ref["scales"])) if a != b)
        before = "an inf/nan step (skipped)" if not ref["stepped"][k - 1] else "a clean step"
        pytest.fail(f"the scale differs from GradScaler's after update() {k - 1} ({before}): yours "
                    f"{ours['scales'][k]:g}, GradScaler's {ref['scales'][k]:g}; scales so far: yours "
                    f"{ours['scales'][:k + 1]}, GradScaler's {ref['scales'][:k + 1]}")
    if ours["stepped"] != ref["stepped"]:
        k = next(i for i, (a, b) in enumerate(zip(ours["stepped"], ref["stepped"])) if a != b)
        pytest.fail(f"iteration {k}: optimizer.step() {'ran' if ours['stepped'][k] else 'was skipped'}"
                    f", GradScaler {'ran' if ref['stepped'][k] else 'skipped'} it")
    for step, (a, b) in enumerate(zip(ours["params"], ref["params"])):
        assert torch.equal(a, b), f"parameters differ from GradScaler's after step {step}"


def test_scale_multiplies_the_loss():
    """scale(loss) multiplies the loss by the scale S, keeping its dtype and its autograd graph."""
    scaler = LossScaler(init_scale=2.0 ** 10)
    loss = torch.tensor(0.75)
    assert scaler.get_scale() == 2.0 ** 10
    scaled = scaler.scale(loss)
    assert scaled.dtype == loss.dtype and scaled.item() == 0.75 * 2 ** 10, (
        f"scale(0.75) with S = 1024 gave {scaled.item()} ({scaled.dtype}): expected 768.0, float32")
    half = scaler.scale(torch.tensor(0.5, dtype=torch.float16))
    assert half.dtype == torch.float16 and half.item() == 512.0, (
        "scale() must keep the loss's dtype (an fp16 loss stays fp16)")
    assert scaled.requires_grad is False and scaler.scale(
        torch.tensor(1.0, requires_grad=True)).requires_grad, "scale() must keep the autograd graph"


def test_unscaled_gradients_are_the_true_gradients():
    """After step(), .grad holds d(loss)/d(param), not the scaled gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    scaler = LossScaler(init_scale=2.0 ** 12)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step changes nothing
    scaler.scale(model(x).pow(2).mean()).backward()
    assert scaler.step(opt) is True, "step() must return True when optimizer.step() ran"
    S = scaler.get_scale()
    for p, g in zip(model.parameters(), expected):
        if torch.equal(p.grad, g * S):
            pytest.fail("after step(), .grad still holds the scaled gradient (S times the true one): "
                        "step() must unscale it, in place, before the optimizer uses it")
        if torch.equal(p.grad, g / S):
            pytest.fail("after step(), .grad holds the true gradient divided by S: it was unscaled "
                        "twice; multiply by to_float32(1 / S) once")
        assert torch.equal(p.grad, g), ("after step(), .grad must hold the true (unscaled) "
                                        "gradient: multiply it by to_float32(1 / S) in place")


def test_inf_or_nan_gradients_skip_the_step_and_back_off():
    """A step with inf or nan gradients is skipped and backs the scale off, once per skipped step.

    The point of dynamic scaling: an overflowed step must not reach the weights."""
    ours = scaler_trace(LossScaler(init_scale=2.0 ** 8, growth_interval=100), steps=6,
                        overflow_steps=(2,), nan_steps=(4,))
    assert ours["stepped"][2] is False, (
        "iteration 2 had an inf loss (its gradients hold inf and nan), yet optimizer.step() ran: "
        "step() must skip the optimizer step when any gradient is not finite (torch.isfinite "
        "catches inf and nan; isinf misses nan), so that an overflowed step never reaches the "
        "weights")
    assert ours["stepped"][4] is False, (
        "iteration 4 had a nan loss (nan gradients), yet optimizer.step() ran: step() must skip it; "
        "torch.isfinite catches inf and nan")
    assert ours["stepped"][:2] == [True, True] and ours["stepped"][3] is True, (
        f"clean steps must run optimizer.step(): stepped = {ours['stepped']}")
    assert ours["scales"][:6] == [256.0, 256.0, 256.0, 128.0, 128.0, 64.0], (
        f"the scale must be multiplied by backoff_factor (0.5) after each skipped step, once; "
        f"got {ours['scales'][:6]}")


def test_clean_steps_grow_the_scale_every_growth_interval():
    """The scale grows by growth_factor after every growth_interval clean steps in a row, as GradScaler's."""
    ours, ref = both(10, init_scale=2.0 ** 3, growth_interval=3)
    assert ours["scales"] == [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0], (
        f"with growth_interval 3 the scale must double after every 3 clean steps in a row "
        f"(8, 8, 8, 16, ...); got {ours['scales']}")
    assert_same(ours, ref)


def test_matches_grad_scaler_over_planted_overflows():
    """Scales, skipped steps and weights match GradScaler's over a run with planted inf and nan losses.

    inf and nan losses at planted steps: skipped steps, back-off, the clean-step count
    restarting."""
    ours, ref = both(24, init_scale=2.0 ** 5, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, overflow_steps=(2, 5, 13, 17), nan_steps=(6,))
    assert not all(ref["stepped"]) and any(ref["stepped"])
    assert_same(ours, ref)


def test_the_scale_is_a_float32_number():
    """With factors that are not powers of two, the scale stays float32, exactly as GradScaler's."""
    ours, ref = both(8, init_scale=100.0, growth_factor=1.1, backoff_factor=0.7, growth_interval=1,
                     overflow_steps=(3,))
    assert ref["scales"] != [float(int(s)) for s in ref["scales"]]  # the scenario rounds for real
    if ours["scales"] != ref["scales"]:
        k = next(i for i, (a, b) in enumerate(zip(ours["scales"], ref["scales"])) if a != b)
        pytest.fail(f"GradScaler keeps S as a float32 number: round it with to_float32 every time it "
                    f"changes (100 * 1.1 is not a float32). Scale {k}: yours {ours['scales'][k]!r}, "
                    f"GradScaler's {ref['scales'][k]!r}")
