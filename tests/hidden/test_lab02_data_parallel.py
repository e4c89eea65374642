"""Hidden tests of lab 02's exercises: edge cases and the systems properties of each step.

Tolerances: float32 rtol 1e-5, atol 1e-6; float64 rtol 1e-12, atol 1e-12.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.tensors import nbytes
from labs.lab02_data_parallel import (ThreadDataParallel, gather, make_mlp, parallel_apply,
                                      replicate, replica_weight, scatter)
from tests.public.test_lab02_data_parallel import Rendezvous  # waits until every replica is in

TOL32 = dict(rtol=1e-5, atol=1e-6)
TOL64 = dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------- scatter

@pytest.mark.exercise("scatter")
@pytest.mark.points(2)
def test_scatter_sizes_match_torch_chunk_everywhere():
    """Chunk sizes follow torch.chunk for many batch sizes and replica counts; chunks rejoin losslessly."""
    for batch_size in range(1, 14):
        batch = torch.randn(batch_size, 3, 2)
        for num_replicas in range(1, 7):
            chunks = list(scatter(batch, num_replicas))
            expected = torch.chunk(batch, num_replicas)
            assert [c.shape for c in chunks] == [e.shape for e in expected], (batch_size, num_replicas)
            assert torch.equal(torch.cat(chunks), batch)


@pytest.mark.exercise("scatter")
def test_scatter_is_differentiable():
    """Gradients flow back through scatter's chunks into the original batch."""
    batch = torch.randn(5, 4, requires_grad=True)
    chunks = scatter(batch, 2)
    (chunks[0].sum() * 2 + chunks[1].sum() * 3).backward()
    assert torch.equal(batch.grad, torch.tensor([[2.0] * 4] * 3 + [[3.0] * 4] * 2))


# -------------------------------------------------------------------------------------- replicate

class Tower(nn.Module):
    """Nested submodules, a buffer, and a tensor attribute path two levels deep."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 4)))
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.tensor([1.5, -0.5]))

    def forward(self, x):
        return self.head(self.body(x)) * self.scale


@pytest.mark.exercise("replicate")
@pytest.mark.points(2)
def test_replicas_1_to_n_hold_their_own_copies_connected_to_the_master():
    """Replicas 1..N-1 hold their own weight memory, stay connected to the master; master untouched."""
    torch.manual_seed(1)
    master = Tower()
    names = [n for n, _ in master.named_parameters()]
    before = {n: p for n, p in master.named_parameters()}
    replicas = replicate(master, 3)
    assert len(replicas) == 3 and len({id(r) for r in replicas}) == 3
    # the master is untouched: the same leaf Parameters, the same values
    assert {n: p for n, p in master.named_parameters()} == before
    assert all(p.is_leaf and isinstance(p, nn.Parameter) for p in master.parameters())
    master_ptrs = {p.untyped_storage().data_ptr() for p in master.parameters()}
    for index, replica in enumerate(replicas):
        for name in names:
            weight = replica_weight(replica, name)
            assert torch.equal(weight, before[name])
            assert weight.grad_fn is not None, f"replica {index} {name}: not connected to the master"
            if index > 0:  # replicas 1..N-1 stand for other devices: real copies
                assert weight.untyped_storage().data_ptr() not in master_ptrs, (index, name)
    # a copy on another device is its own memory: replicas 1 and 2 must not share either
    assert (replica_weight(replicas[1], "head.weight").untyped_storage().data_ptr()
            != replica_weight(replicas[2], "head.weight").untyped_storage().data_ptr())


@pytest.mark.exercise("replicate")
@pytest.mark.points(2)
def test_master_gradient_is_the_sum_over_replicas_of_a_nested_module():
    """Master gradients are the sum over replicas, for a nested module with a buffer (float64)."""
    torch.manual_seed(2)
    master, reference = Tower().double(), Tower().double()
    reference.load_state_dict(master.state_dict())
    xs = [torch.randn(3, 6, dtype=torch.float64) for _ in range(3)]
    replicas = replicate(master, 3)
    outs = [replica(x) for replica, x in zip(replicas, xs)]
    for out, x in zip(outs, xs):
        torch.testing.assert_close(out, reference(x), **TOL64)
    sum((k + 1) * out.pow(2).sum() for k, out in enumerate(outs)).backward()
    sum((k + 1) * reference(x).pow(2).sum() for k, x in enumerate(xs)).backward()
    for (name, got), ref in zip(master.named_parameters(), reference.parameters()):
        assert got.grad is not None, f"no gradient reached master {name}"
        torch.testing.assert_close(got.grad, ref.grad, **TOL64)


@pytest.mark.exercise("replicate")
def test_replicate_under_no_grad_and_repeated():
    """replicate works under torch.no_grad(), and a later call sees the master's updated weights."""
    master = make_mlp(4, 1, 2)
    x = torch.randn(2, 4)
    with torch.no_grad():
        replicas = replicate(master, 2)
        out = replicas[1](x)
    assert not out.requires_grad
    torch.testing.assert_close(out, master(x).detach(), **TOL32)
    # a second replicate after an update sees the new weights (replicas are made every forward)
    with torch.no_grad():
        master[0].weight.add_(1.0)
    torch.testing.assert_close(replicate(master, 2)[1](x), master(x), **TOL32)


# --------------------------------------------------------------------------------- parallel_apply

@pytest.mark.exercise("parallel_apply")
@pytest.mark.points(2)
def test_replicas_run_concurrently_in_their_own_threads():
    """parallel_apply runs every replica in its own thread, all at the same time; outputs in order."""
    num_replicas = 4
    barrier, seen = threading.Barrier(num_replicas, timeout=10), []
    replicas = [Rendezvous(barrier, seen) for _ in range(num_replicas)]
    inputs = [torch.full((1,), float(i)) for i in range(num_replicas)]
    try:
        outputs = parallel_apply(replicas, inputs)
    except threading.BrokenBarrierError:
        outputs = None
    if outputs is None or "broken" in seen:
        pytest.fail(f"the {num_replicas} replicas never ran at the same time: one thread each")
    assert [o.item() for o in outputs] == [0.0, 2.0, 4.0, 6.0], "outputs out of replica order"
    assert len(set(seen)) == num_replicas, f"{len(set(seen))} threads for {num_replicas} replicas"
    assert threading.get_ident() not in seen, "a replica ran in the calling thread"


@pytest.mark.exercise("parallel_apply")
def test_grad_mode_reaches_the_threads():
    """The caller's grad mode (no_grad or enabled) also holds inside the worker threads."""
    replicas, inputs = [nn.Linear(3, 1), nn.Linear(3, 1)], [torch.randn(2, 3), torch.randn(2, 3)]
    with torch.no_grad():
        assert not any(o.requires_grad for o in parallel_apply(replicas, inputs)), (
            "under torch.no_grad() the threads must run without grad too")
    assert all(o.requires_grad for o in parallel_apply(replicas, inputs)), (
        "with grad enabled the outputs must require grad")


@pytest.mark.exercise("parallel_apply")
@pytest.mark.points(2)
def test_first_error_is_reraised_after_every_thread_finished():
    """When replicas fail, the first replica's error is re-raised, only after every thread finished."""
    finished = []
    first_error = KeyError("replica 1")

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.3)
            finished.append(True)
            return x

    class Fails(nn.Module):
        def __init__(self, error):
            super().__init__()
            self.error = error

        def forward(self, x):
            raise self.error

    replicas = [Slow(), Fails(first_error), Fails(RuntimeError("replica 2")), Slow()]
    with pytest.raises(KeyError) as caught:
        parallel_apply(replicas, [torch.ones(1)] * 4)
    assert caught.value is first_error
    assert finished == [True, True], "the caller returned before all threads were joined"


# ----------------------------------------------------------------------------------------- gather

@pytest.mark.exercise("gather")
@pytest.mark.points(2)
def test_gather_nested_outputs_with_gradients():
    """gather handles nested outputs (dicts, tuples) and passes gradients back to every part."""
    parts = [{"logits": torch.randn(rows, 3, requires_grad=True),
              "aux": (torch.randn(rows, requires_grad=True),)} for rows in (2, 1)]
    out = gather(parts)
    assert set(out) == {"logits", "aux"} and isinstance(out["aux"], tuple)
    assert torch.equal(out["logits"], torch.cat([p["logits"] for p in parts]))
    assert torch.equal(out["aux"][0], torch.cat([p["aux"][0] for p in parts]))
    (out["logits"].sum() + 3 * out["aux"][0].sum()).backward()
    assert torch.equal(parts[1]["logits"].grad, torch.ones(1, 3))
    assert torch.equal(parts[1]["aux"][0].grad, torch.full((1,), 3.0))


@pytest.mark.exercise("gather")
def test_gather_lands_on_replica_0s_device():
    """The gathered output lands on replica 0's device."""
    out = gather([torch.zeros(2, 3, device="meta"), torch.ones(1, 3)])
    assert out.device.type == "meta" and out.shape == (3, 3)


# ------------------------------------------------------------------ all four: ThreadDataParallel

@pytest.mark.exercise("ThreadDataParallel")
@pytest.mark.points(3)
@pytest.mark.parametrize("num_replicas,batch_size", [(2, 5), (3, 4), (3, 10), (4, 1)])
def test_training_steps_equal_the_plain_module_in_float64(num_replicas, batch_size):
    """SGD steps with ThreadDataParallel equal the plain module (float64), including uneven splits."""
    torch.manual_seed(3)
    plain, master = make_mlp(6, 2, 4).double(), make_mlp(6, 2, 4).double()
    tdp = ThreadDataParallel(master, num_replicas)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_dp = torch.optim.SGD(master.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(batch_size, 6, dtype=torch.float64)
        y = torch.randint(0, 4, (batch_size,))
        x_plain, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
        for opt in (opt_plain, opt_dp):
            opt.zero_grad()
        out_plain, out_dp = plain(x_plain), tdp(x_dp)
        torch.testing.assert_close(out_dp, out_plain, **TOL64)
        F.cross_entropy(out_plain, y).backward()
        F.cross_entropy(out_dp, y).backward()
        torch.testing.assert_close(x_dp.grad, x_plain.grad, **TOL64)
        assert tdp.last_step.num_replicas == len(torch.chunk(x, num_replicas))
        opt_plain.step()
        opt_dp.step()
    for got, ref in zip(master.parameters(), plain.parameters()):
        torch.testing.assert_close(got, ref, **TOL64)


@pytest.mark.exercise("ThreadDataParallel")
@pytest.mark.points(2)
def test_parameter_traffic_through_replica_0_is_2C_times_N_minus_1():
    """last_step.moved reports the parameter broadcast and gradient reduce bytes, for many replica counts."""
    master = make_mlp(16, 2, 4)
    param_bytes = nbytes(master.parameters())
    for num_replicas in (1, 2, 3, 5):
        master.zero_grad()
        tdp = ThreadDataParallel(master, num_replicas)
        F.cross_entropy(tdp(torch.randn(10, 16)), torch.randint(0, 4, (10,))).backward()
        moved = tdp.last_step.moved
        assert moved["broadcast params"] == param_bytes * (num_replicas - 1)
        assert moved["reduce param grads"] == param_bytes * (num_replicas - 1)
