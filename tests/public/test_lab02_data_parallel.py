"""Public tests of lab 02's exercises: scatter, replicate, parallel_apply, gather (one process).

Run:  .venv/bin/python -m pytest tests/public/test_lab02_data_parallel.py -q
Reference: the plain module on the whole batch. Tolerances (float32): rtol 1e-5, atol 1e-6.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.lab02_data_parallel import (ThreadDataParallel, gather, make_mlp, parallel_apply,
                                      replicate, scatter)

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("scatter")
def test_scatter_uses_chunk_sizes():
    batch = torch.arange(10.0).reshape(10, 1)
    chunks = scatter(batch, 3)
    assert [c.shape[0] for c in chunks] == [4, 4, 2]
    assert torch.equal(torch.cat(list(chunks)), batch)
    small = scatter(batch[:2], 3)  # fewer rows than replicas: fewer chunks
    assert [c.shape[0] for c in small] == [1, 1]


@pytest.mark.exercise("replicate")
def test_replicas_compute_like_the_master_and_send_gradients_back():
    torch.manual_seed(0)
    master = make_mlp(8, 1, 3)
    x = torch.randn(5, 8)
    replicas = replicate(master, 2)
    assert len(replicas) == 2
    assert all(r is not master for r in replicas)
    expected = master(x)
    for replica in replicas:
        torch.testing.assert_close(replica(x), expected, **TOL)
    # each replica sees the same batch: the master's gradient must be twice the plain one
    sum(replica(x).sum() for replica in replicas).backward()
    reference = make_mlp(8, 1, 3)
    reference(x).sum().backward()
    for got, ref in zip(master.parameters(), reference.parameters()):
        assert got.grad is not None, "no gradient reached the master parameter"
        torch.testing.assert_close(got.grad, 2 * ref.grad, **TOL)


@pytest.mark.exercise("parallel_apply")
def test_parallel_apply_matches_a_loop_and_reraises():
    torch.manual_seed(0)
    replicas = [nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)]
    inputs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(1, 4)]
    outputs = parallel_apply(replicas, inputs)
    assert len(outputs) == 3
    for out, replica, x in zip(outputs, replicas, inputs):
        torch.testing.assert_close(out, replica(x), **TOL)

    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("replica failed on purpose")

    with pytest.raises(ValueError, match="on purpose"):
        parallel_apply([nn.Linear(4, 2), Broken()], inputs[:2])


@pytest.mark.exercise("gather")
def test_gather_concatenates_in_replica_order():
    parts = [torch.full((2, 3), 0.0, requires_grad=True), torch.full((1, 3), 1.0, requires_grad=True)]
    out = gather(parts)
    assert out.shape == (3, 3)
    assert torch.equal(out, torch.tensor([[0.0] * 3, [0.0] * 3, [1.0] * 3]))
    (out * torch.arange(3.0).reshape(3, 1)).sum().backward()
    assert torch.equal(parts[1].grad, torch.full((1, 3), 2.0))


@pytest.mark.exercise("ThreadDataParallel")
@pytest.mark.parametrize("num_replicas,batch_size", [(2, 7), (3, 7), (3, 9)])
def test_thread_data_parallel_equals_the_plain_module(num_replicas, batch_size):
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))
    plain, master = make_mlp(8, 2, 3), make_mlp(8, 2, 3)
    x_plain, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_plain = plain(x_plain)
    out_dp = ThreadDataParallel(master, num_replicas)(x_dp)
    torch.testing.assert_close(out_dp, out_plain, **TOL)
    F.cross_entropy(out_plain, y).backward()
    F.cross_entropy(out_dp, y).backward()
    torch.testing.assert_close(x_dp.grad, x_plain.grad, **TOL)
    for got, ref in zip(master.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, **TOL)
