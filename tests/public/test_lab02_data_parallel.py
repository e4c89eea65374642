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
import time

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
    """scatter splits the batch along dim 0 into torch.chunk's sizes, without empty pieces or loss."""
    batch = torch.arange(10.0).reshape(10, 1).requires_grad_(True)
    chunks = scatter(batch, 3)
    sizes = [c.shape[0] for c in chunks]
    assert not (len(sizes) > 1 and all(size == 10 for size in sizes)), (
        f"10 rows over 3 replicas gave {sizes}: every replica got the whole batch; scatter splits "
        "it, so that each replica computes on its own rows")
    assert sizes == [4, 4, 2], f"10 rows over 3 replicas gave {sizes}: follow torch.chunk, [4, 4, 2]"
    assert torch.equal(torch.cat(list(chunks)), batch), "the pieces must concatenate to the batch"
    assert all(c.requires_grad for c in chunks), (
        "the pieces do not require grad: the input gradient could not flow back through scatter "
        "to the batch (torch.chunk's views keep the graph; don't detach or copy them out of it)")
    small = [c.shape[0] for c in scatter(batch[:2], 3)]
    assert small == [1, 1], f"2 rows over 3 replicas gave {small}: fewer pieces, no empty ones"


@pytest.mark.exercise("replicate")
def test_replicas_compute_like_the_master_and_send_gradients_back():
    """Replicas compute what the master computes, and their gradients add up in the master's."""
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
    """Replicas 1..N-1 hold their weights in memory of their own, not in the master's."""
    master = make_mlp(8, 1, 3)
    master_storage = {p.untyped_storage().data_ptr() for p in master.parameters()}
    replicas = replicate(master, 3)
    for index in (1, 2):
        for name, _ in master.named_parameters():
            weight = replica_weight(replicas[index], name)
            assert weight.untyped_storage().data_ptr() not in master_storage, (
                f"replica {index}'s {name} shares the master's memory: replicas 1..N-1 stand for "
                "other devices and need copies of their own (e.g. p.clone())")
    for name, _ in master.named_parameters():
        one, two = (replica_weight(replicas[i], name).untyped_storage().data_ptr() for i in (1, 2))
        assert one != two, (
            f"replicas 1 and 2 share one copy of {name}: each replica stands for a device of its "
            "own and needs a copy of its own (one p.clone() per replica)")


@pytest.mark.exercise("parallel_apply")
def test_parallel_apply_matches_a_loop_and_reraises():
    """parallel_apply returns replicas[i](inputs[i]) in replica order and re-raises a replica's error."""
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

    finished = []

    class Slow(nn.Module):  # still running when Broken has failed
        def forward(self, x):
            time.sleep(0.3)
            finished.append(True)
            return x

    try:
        parallel_apply([nn.Linear(4, 2), Broken(), Slow()], inputs)
    except ValueError as exc:
        assert "on purpose" in str(exc), f"re-raise the replica's own exception, got {exc!r}"
    else:
        pytest.fail("an exception raised in a replica's thread vanished: catch it in the thread "
                    "and re-raise it in the caller after joining")
    assert finished == [True], (
        "parallel_apply raised replica 1's error while replica 2's thread was still running: join "
        "every thread first, then re-raise")


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
    """parallel_apply runs the replicas at the same time, each in a thread of its own."""
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
    """Under the caller's torch.no_grad(), the replicas' threads compute without grad too."""
    replicas, inputs = [nn.Linear(3, 1), nn.Linear(3, 1)], [torch.randn(2, 3), torch.randn(2, 3)]
    with torch.no_grad():
        outputs = parallel_apply(replicas, inputs)
    assert not any(o.requires_grad for o in outputs), (
        "under torch.no_grad() the outputs require grad: grad mode is thread-local, so set the "
        "caller's torch.is_grad_enabled() inside each thread")


@pytest.mark.exercise("gather")
def test_gather_concatenates_in_replica_order():
    """gather concatenates the outputs along dim 0 in replica order and stays differentiable."""
    even = gather([torch.zeros(2, 3), torch.ones(2, 3)])
    assert isinstance(even, torch.Tensor), (
        f"gather returned a {type(even).__name__}: concatenate the replicas' outputs into one "
        "tensor, the whole batch's output on replica 0")
    assert even.shape == (4, 3), (
        f"two (2, 3) outputs gathered into shape {tuple(even.shape)}, expected (4, 3): concatenate "
        "along the batch dimension, dim 0 (torch.cat, not torch.stack; not the feature dimension)")
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
    # replica 0 on the meta device (shapes only, no data): the result must land there
    try:
        on_meta = gather([torch.zeros(1, 3, device="meta"), torch.ones(2, 3)])
    except NotImplementedError as exc:  # "Cannot copy out of meta tensor": moved off replica 0
        pytest.fail(f"gather moved replica 0's output (on the meta device) elsewhere ({exc}): "
                    "gather on replica 0's device, outputs[0].device")
    assert on_meta.device.type == "meta", (
        f"with replica 0's output on the meta device the gathered output is on {on_meta.device}: "
        "gather on replica 0's device (outputs[0].device), where DataParallel computes the loss")


@pytest.mark.exercise("gather")
def test_gather_keeps_the_structure_of_tuple_and_dict_outputs():
    """gather concatenates every tensor of tuple and dict outputs, keeping their structure."""
    parts = [(torch.zeros(2, 3), {"aux": torch.zeros(2)}), (torch.ones(1, 3), {"aux": torch.ones(1)})]
    try:
        out = gather(parts)
    except (AttributeError, TypeError) as exc:
        pytest.fail(f"gather of replicas returning (tensor, {{'aux': tensor}}) raised {exc!r}: a "
                    "model may return a tuple, list or dict of tensors; gather each part")
    assert isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict), (
        f"replicas returning (tensor, {{'aux': tensor}}) gathered into {type(out).__name__}: a "
        "model may return a tuple, list or dict of tensors; gather each part, keeping the structure")
    assert torch.equal(out[0], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3])), (
        "the tuple's first tensor must be both replicas' first tensors concatenated along dim 0")
    assert torch.equal(out[1]["aux"], torch.tensor([0.0, 0.0, 1.0])), (
        "the dict's 'aux' tensor must be both replicas' 'aux' tensors concatenated along dim 0")


@pytest.mark.exercise("ThreadDataParallel")
@pytest.mark.parametrize("num_replicas,batch_size", [(2, 7), (3, 7), (3, 9)])
def test_thread_data_parallel_equals_the_plain_module(num_replicas, batch_size):
    """ThreadDataParallel gives the plain module's outputs, input gradients and parameter gradients."""
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
