"""Hidden tests of the lab 07 exercise: LossScaler, compared with torch.amp.GradScaler("cpu").

Stricter than the public tests: nan as well as inf, overflow exactly when growth was due, growth
capped at float32's range, scales that are not powers of two, Adam (whose step count must not move
on a skipped step), several optimizers, parameters without gradients, and a real fp16 autocast
training run with overflows.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.lab07_low_precision import (LossScaler, make_autoencoder, make_signals,
                                      reconstruction_loss, scaler_trace)

pytestmark = pytest.mark.exercise("LossScaler")


def both(steps, **kwargs):
    planted = {k: kwargs.pop(k) for k in ("overflow_steps", "nan_steps") if k in kwargs}
    return (scaler_trace(LossScaler(**kwargs), steps=steps, **planted),
            scaler_trace(torch.amp.GradScaler("cpu", **kwargs), steps=steps, **planted))


def assert_same(ours, ref, exact_params=True):
    assert ours["scales"] == ref["scales"]
    assert ours["stepped"] == ref["stepped"]
    for a, b in zip(ours["params"], ref["params"]):
        if exact_params:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.points(2)
def test_nan_and_inf_are_both_skipped_and_back_off():
    """Steps with nan or inf gradients are both skipped and back the scale off, as GradScaler does."""
    ours, ref = both(20, init_scale=2.0 ** 8, growth_interval=2, overflow_steps=(3, 11), nan_steps=(4, 7, 15))
    assert sum(not s for s in ref["stepped"]) == 5
    assert_same(ours, ref)


def test_overflow_on_the_step_growth_was_due_and_runs_of_overflows():
    """Matches GradScaler when an overflow hits the step growth was due, and on runs of overflows."""
    # growth_interval 4: steps 0-2 clean, 3 overflows (no growth, count restarts), 4-7 clean -> grow.
    ours, ref = both(16, init_scale=2.0 ** 6, growth_interval=4, overflow_steps=(3, 9, 10, 11))
    assert_same(ours, ref)


def test_growth_interval_one_grows_every_clean_step():
    """With growth_interval=1 the scale grows on every clean step, as GradScaler's does."""
    ours, ref = both(8, init_scale=1.0, growth_interval=1, overflow_steps=(5,))
    assert ref["scales"][:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert_same(ours, ref)


def test_scale_never_grows_past_float32():
    """The scale never grows past float32's range, as GradScaler's does."""
    ours, ref = both(5, init_scale=2.0 ** 126, growth_factor=4.0, growth_interval=1)
    assert ref["scales"] == [2.0 ** 126] * 6
    assert_same(ours, ref)


@pytest.mark.points(2)
def test_factors_that_are_not_powers_of_two():
    """Scales and parameters match GradScaler with growth/backoff factors that are not powers of two.

    The scale lives in float32 (exact equality), the inverse is float32(1/S): parameters match."""
    ours, ref = both(18, init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2,
                     overflow_steps=(2, 7, 8, 14))
    assert any(s != float(int(s)) for s in ref["scales"])  # e.g. 0.3 * 9000 in float32
    assert_same(ours, ref, exact_params=False)


def _adam_run(scaler, steps, overflow_steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(12, 5), torch.randn(12, 2)
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (math.inf if step in overflow_steps else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        first = next(iter(opt.state.values()), {})
        out.append((scaler.get_scale(), float(first.get("step", 0)),
                    [p.detach().clone() for p in model.parameters()]))
    return out


def test_adam_state_does_not_advance_on_skipped_steps():
    """Skipped steps leave Adam's state (its step count too) alone; scales and weights match GradScaler."""
    ours = _adam_run(LossScaler(init_scale=2.0 ** 10, growth_interval=3), 12, {0, 4, 5})
    ref = _adam_run(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3), 12, {0, 4, 5})
    assert ref[-1][1] == 9.0
    for (s1, n1, p1), (s2, n2, p2) in zip(ours, ref):
        assert s1 == s2 and n1 == n2
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def _two_optimizer_run(scaler, steps, overflow_a):
    """Two parts, two optimizers; inf only in part a's gradients at `overflow_a` steps. Part b also
    has a parameter that never gets a gradient (.grad stays None) in a second param group."""
    torch.manual_seed(1)
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    unused = nn.Parameter(torch.ones(2))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.5)
    opt_b = torch.optim.SGD([{"params": b.parameters()}, {"params": [unused], "lr": 1.0}], lr=0.05)
    ran = {"a": [], "b": []}
    opt_a.register_step_post_hook(lambda *_: ran["a"].append(step))
    opt_b.register_step_post_hook(lambda *_: ran["b"].append(step))
    x = torch.randn(6, 3)
    current = {"step": -1}
    # inf reaches a's weight gradient only, at the planted steps
    a.weight.register_hook(lambda g: g * math.inf if current["step"] in overflow_a else g)
    trace = []
    for step in range(steps):
        current["step"] = step
        opt_a.zero_grad()
        opt_b.zero_grad()
        h = a(x)
        loss = b(h).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        params = [*a.parameters(), *b.parameters(), unused]
        trace.append((scaler.get_scale(), [p.detach().clone() for p in params]))
    return trace, ran


@pytest.mark.points(2)
def test_two_optimizers_skip_independently_and_update_backs_off_once():
    """Two optimizers skip independently, update backs off once per step; grad-less params are fine."""
    settings = dict(init_scale=2.0 ** 4, growth_interval=2)
    ours, ran_ours = _two_optimizer_run(LossScaler(**settings), 10, {3, 7})
    ref, ran_ref = _two_optimizer_run(torch.amp.GradScaler("cpu", **settings), 10, {3, 7})
    assert 3 not in ran_ref["a"] and 3 in ran_ref["b"]  # the scenario does what it says
    assert ran_ours == ran_ref
    for (s1, p1), (s2, p2) in zip(ours, ref):
        assert s1 == s2
        assert all(torch.equal(x, y) for x, y in zip(p1, p2))


def test_step_reports_skips_and_update_needs_a_step():
    """step() reports whether it stepped, a skip changes nothing, update() before any step raises."""
    scaler = LossScaler(init_scale=4.0)
    with pytest.raises(RuntimeError):
        scaler.update()
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale((p * math.inf).sum()).backward()
    assert scaler.step(opt) is False
    assert torch.equal(p.detach(), torch.ones(3))
    scaler.update()
    assert scaler.get_scale() == 2.0
    p.grad = None
    scaler.scale(p.sum()).backward()
    assert scaler.step(opt) is True
    assert torch.equal(p.detach(), torch.zeros(3))  # grad 1 after unscaling, lr 1


def _fp16_training(scaler, steps):
    torch.manual_seed(0)
    data = make_signals(512, amplitude=1.0)
    model = make_autoencoder(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        batch = data[(step * 64) % 512:(step * 64) % 512 + 64]
        opt.zero_grad(set_to_none=True)
        loss = reconstruction_loss(model, batch, "fp16")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), loss.item()))
    return out, [p.detach().clone() for p in model.parameters()]


@pytest.mark.points(2)
def test_fp16_autocast_training_with_real_overflows_matches_grad_scaler():
    """fp16 autocast training with real overflows: scales, losses and weights equal GradScaler's.

    init_scale 2^24 makes fp16 gradients overflow for real until the scale has backed off."""
    ours, p_ours = _fp16_training(LossScaler(init_scale=2.0 ** 24, growth_interval=4), 24)
    ref, p_ref = _fp16_training(torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=4), 24)
    assert min(s for s, _ in ref) < 2.0 ** 24  # there were overflows
    assert ours == ref
    assert all(torch.equal(a, b) for a, b in zip(p_ours, p_ref))
