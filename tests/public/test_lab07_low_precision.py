"""Public tests of the lab 07 exercise: LossScaler (labs/lab07_low_precision.py).

Run:  python -m pytest tests/public/test_lab07_low_precision.py -q

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
    assert ours["scales"] == ref["scales"], "scale after each update() differs from GradScaler's"
    assert ours["stepped"] == ref["stepped"], "the steps that ran / were skipped differ from GradScaler's"
    for step, (a, b) in enumerate(zip(ours["params"], ref["params"])):
        assert torch.equal(a, b), f"parameters differ from GradScaler's after step {step}"


def test_scale_multiplies_the_loss():
    scaler = LossScaler(init_scale=2.0 ** 10)
    loss = torch.tensor(0.75)
    assert scaler.get_scale() == 2.0 ** 10
    scaled = scaler.scale(loss)
    assert scaled.dtype == loss.dtype and scaled.item() == 0.75 * 2 ** 10
    half = scaler.scale(torch.tensor(0.5, dtype=torch.float16))
    assert half.dtype == torch.float16 and half.item() == 512.0


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
    assert scaler.step(opt) is True
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)


def test_clean_steps_grow_the_scale_every_growth_interval():
    ours, ref = both(10, init_scale=2.0 ** 3, growth_interval=3)
    assert ours["scales"] == [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0]
    assert_same(ours, ref)


def test_matches_grad_scaler_over_planted_overflows():
    """inf losses at planted steps: skipped steps, back-off, and the clean-step count restarting."""
    ours, ref = both(24, init_scale=2.0 ** 5, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, overflow_steps=(2, 5, 6, 13, 17))
    assert not all(ref["stepped"]) and any(ref["stepped"])
    assert_same(ours, ref)
