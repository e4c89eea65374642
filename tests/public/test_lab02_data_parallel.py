"""Public tests of lab 02's exercises: scatter, replicate, parallel_apply, gather (one process).

Run:  ./run.sh check 02
Reference: the plain module on the whole batch. Tolerances (float32): rtol 1e-5, atol 1e-6.
They also check the point of each step: replicas connected to the master in autograd and holding
copies of their own, replicas running at the same time in threads of their own (a barrier that
opens only when every replica waits on it together), grad mode and errors carried across threads,
and gather staying differentiable.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.lab02_data_parallel import (ThreadDataParallel, gather, make_mlp, parallel_apply,
                                      replica_weight, replicate, scatter)

TOL = dict(rtol=1e-5, atol=1e-6)
WAIT_S = 10  # barrier timeout: only replicas that never run together reach it


@pytest.mark.exercise("scatter")
def test_scatter_uses_chunk_sizes():
    batch = torch.arange(10.0).reshape(10, 1)
    chunks = scatter(batch, 3)
    sizes = [c.shape[0] for c in chunks]
    assert sizes == [4, 4, 2], f"10 rows over 3 replicas gave {sizes}: follow torch.chunk, [4, 4, 2]"
    assert torch.equal(torch.cat(list(chunks)), batch), "the pieces must concatenate to the batch"
    small = [c.shape[0] for c in scatter(batch[:2], 3)]
    assert small == [1, 1], f"2 rows over 3 replicas gave {small}: fewer pieces, no empty ones"


@pytest.mark.exercise("replicate")
def test_replicas_compute_like_the_master_and_send_gradients_back():
    torch.manual_seed(0)
    master = make_mlp(8, 1, 3)
    x = torch.randn(5, 8)
    replicas = replicate(master, 2)
    assert len(replicas) == 2, f"asked for 2 replicas, got {len(replicas)}"
    assert all(r is not master for r in replicas), "a replica must be a new module, not the master"
    expected = master(x)
    for replica in replicas:
        torch.testing.assert_close(replica(x), expected, **TOL,
                                   msg="a replica computes other outputs than the master")
    # each replica sees the same batch: the master's gradient must be twice the plain one
    outs = [replica(x) for replica in replicas]
    assert all(out.requires_grad for out in outs), (
        "a replica's output does not require grad: the replicas' weights must be computed from "
        "the master's by a differentiable op (not copy.deepcopy, not detach)")
    sum(out.sum() for out in outs).backward()
    reference = make_mlp(8, 1, 3)
    reference(x).sum().backward()
    for got, ref in zip(master.parameters(), reference.parameters()):
        assert got.grad is not None, (
            "no gradient reached the master parameter: the replicas' weights must be computed from "
            "the master's by a differentiable op (not copy.deepcopy, not detach)")
        torch.testing.assert_close(got.grad, 2 * ref.grad, **TOL,
                                   msg="the master's gradient is not the sum over replicas")


@pytest.mark.exercise("replicate")
def test_replicas_after_the_first_hold_copies_of_their_own():
    master = make_mlp(8, 1, 3)
    master_storage = {p.untyped_storage().data_ptr() for p in master.parameters()}
    replicas = replicate(master, 3)
    for index in (1, 2):
        for name, _ in master.named_parameters():
            weight = replica_weight(replicas[index], name)
            assert weight.untyped_storage().data_ptr() not in master_storage, (
                f"replica {index}'s {name} shares the master's memory: replicas 1..N-1 stand for "
                "other devices and need copies of their own (e.g. p.clone())")


@pytest.mark.exercise("parallel_apply")
def test_parallel_apply_matches_a_loop_and_reraises():
    torch.manual_seed(0)
    replicas = [nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)]
    inputs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(1, 4)]
    outputs = parallel_apply(replicas, inputs)
    assert len(outputs) == 3, f"3 replicas gave {len(outputs)} outputs"
    for out, replica, x in zip(outputs, replicas, inputs):
        torch.testing.assert_close(out, replica(x), **TOL,
                                   msg="outputs must be replicas[i](inputs[i]), in replica order")

    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("replica failed on purpose")

    try:
        parallel_apply([nn.Linear(4, 2), Broken()], inputs[:2])
    except ValueError as exc:
        assert "on purpose" in str(exc), f"re-raise the replica's own exception, got {exc!r}"
    else:
        pytest.fail("an exception raised in a replica's thread vanished: catch it in the thread "
                    "and re-raise it in the caller after joining")


class Rendezvous(nn.Module):
    """Waits until every replica is inside forward at once: fails if they run one after another."""

    def __init__(self, barrier: threading.Barrier, seen: list):
        super().__init__()
        self.barrier, self.seen = barrier, seen

    def forward(self, x):
        self.seen.append(threading.get_ident())
        try:
            self.barrier.wait()  # BrokenBarrierError after WAIT_S when run one after another
        except threading.BrokenBarrierError:
            self.seen.append("broken")  # seen even if parallel_apply swallows the error
            raise
        return x * 2


@pytest.mark.exercise("parallel_apply")
def test_replicas_run_at_the_same_time_in_threads_of_their_own():
    barrier, seen = threading.Barrier(2, timeout=WAIT_S), []
    replicas = [Rendezvous(barrier, seen), Rendezvous(barrier, seen)]
    try:
        outputs = parallel_apply(replicas, [torch.ones(1), torch.full((1,), 2.0)])
    except threading.BrokenBarrierError:
        outputs = None
    if outputs is None or "broken" in seen:
        pytest.fail("the 2 replicas never ran at the same time (one after another): start one "
                    "thread per replica, all of them before joining any")
    assert [o.item() for o in outputs] == [2.0, 4.0], "outputs out of replica order"
    assert len(set(seen)) == 2, "the replicas ran in the same thread: one thread each"
    assert threading.get_ident() not in seen, "a replica ran in the calling thread"


@pytest.mark.exercise("parallel_apply")
def test_grad_mode_reaches_the_threads():
    replicas, inputs = [nn.Linear(3, 1), nn.Linear(3, 1)], [torch.randn(2, 3), torch.randn(2, 3)]
    with torch.no_grad():
        outputs = parallel_apply(replicas, inputs)
    assert not any(o.requires_grad for o in outputs), (
        "under torch.no_grad() the outputs require grad: grad mode is thread-local, so set the "
        "caller's torch.is_grad_enabled() inside each thread")


@pytest.mark.exercise("gather")
def test_gather_concatenates_in_replica_order():
    parts = [torch.full((2, 3), 0.0, requires_grad=True), torch.full((1, 3), 1.0, requires_grad=True)]
    out = gather(parts)
    assert out.shape == (3, 3), f"gathered shape {tuple(out.shape)}, expected (3, 3)"
    assert out.requires_grad, "the gathered output does not require grad: keep gather differentiable"
    assert torch.equal(out, torch.tensor([[0.0] * 3, [0.0] * 3, [1.0] * 3])), (
        "gather must concatenate along dim 0 in replica order")
    (out * torch.arange(3.0).reshape(3, 1)).sum().backward()
    assert parts[1].grad is not None, "no gradient reached replica 1's output: keep gather differentiable"
    assert torch.equal(parts[1].grad, torch.full((1, 3), 2.0)), (
        "replica 1 got the wrong slice of the output gradient")


@pytest.mark.exercise("ThreadDataParallel")
@pytest.mark.parametrize("num_replicas,batch_size", [(2, 7), (3, 7), (3, 9)])
def test_thread_data_parallel_equals_the_plain_module(num_replicas, batch_size):
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))
    plain, master = make_mlp(8, 2, 3), make_mlp(8, 2, 3)
    x_plain, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_plain = plain(x_plain)
    out_dp = ThreadDataParallel(master, num_replicas)(x_dp)
    where = f"{num_replicas} replicas, batch {batch_size}"
    torch.testing.assert_close(out_dp, out_plain, **TOL, msg=f"{where}: outputs differ")
    assert out_dp.requires_grad, f"{where}: the output does not require grad (replicate, gather)"
    F.cross_entropy(out_plain, y).backward()
    F.cross_entropy(out_dp, y).backward()
    assert x_dp.grad is not None, f"{where}: no gradient reached the input (scatter, gather)"
    torch.testing.assert_close(x_dp.grad, x_plain.grad, **TOL, msg=f"{where}: input grads differ")
    for got, ref in zip(master.parameters(), plain.parameters()):
        assert got.grad is not None, f"{where}: no gradient reached a master parameter"
        torch.testing.assert_close(got.grad, ref.grad, **TOL,
                                   msg=f"{where}: parameter gradients differ")
