"""Public tests of the lab 03 homework `fit` (labs/lab03_classifier.py): a Transformer classifier
trained with DDP on 2 processes on scikit-learn's digits, 5 epochs.

A correct solution reaches about 94% test accuracy after 5 epochs (97% after 12); we ask for 85%.
A model that does not learn stays near 10%. Besides accuracy, the tests watch the training from
outside: a forward hook on the model records every forward pass, so the tests know how many
batches each rank ran, of what size, and the loss of each; the epoch losses `fit` reports must be
the mean of those batch losses over every rank.

Run:  ./run.sh check 03
"""
from __future__ import annotations

import math

import pytest

from labs.lab03_classifier import fit
from tests.harness import launch_ranks


pytestmark = pytest.mark.exercise("ddp_classifier")

EPOCHS = 5
MIN_ACCURACY = 0.85


@pytest.fixture(scope="module")
def runs():
    return launch_ranks(__file__, nproc=2, timeout=180, needs=[fit])


def test_reaches_test_accuracy(runs):
    """After 5 epochs on 2 ranks the classifier reaches at least 85% test accuracy."""
    for rank, res in runs.items():
        assert res["test_accuracy"] >= MIN_ACCURACY, (
            f"rank {rank}: test accuracy {res['test_accuracy']:.3f} after {EPOCHS} epochs, "
            f"expected >= {MIN_ACCURACY}")


def test_parameters_identical_on_every_rank(runs):
    """Both ranks end with the same parameters (DDP averages the gradients every step)."""
    assert runs[0]["params_head"] == runs[1]["params_head"], \
        "ranks ended with different parameters: are the gradients all-reduced (DDP)?"


def test_each_rank_trains_on_a_disjoint_shard(runs):
    """Every epoch, the two ranks train on disjoint halves that together cover the training set."""
    from labs.lab03_classifier import TRAIN_SIZE

    for epoch in range(2):
        shards = [runs[r]["indices"][epoch] for r in (0, 1)]
        assert len(shards[0]) == len(shards[1]) == TRAIN_SIZE // 2, (
            f"epoch {epoch}: each rank trained on {len(shards[0])} and {len(shards[1])} samples, "
            f"expected {TRAIN_SIZE // 2}: give the DataLoader a DistributedSampler")
        shared = set(shards[0]) & set(shards[1])
        assert not shared, (
            f"epoch {epoch}: the ranks share {len(shared)} samples: every rank's "
            "DistributedSampler needs the same seed (and num_replicas=world_size, rank=rank), so "
            "that they deal out one permutation between them")
        assert set(shards[0]) | set(shards[1]) == set(range(TRAIN_SIZE)), (
            f"epoch {epoch}: the two shards together miss "
            f"{len(set(range(TRAIN_SIZE)) - set(shards[0]) - set(shards[1]))} training samples")
    for rank, res in runs.items():
        assert res["samples_seen"] == EPOCHS * TRAIN_SIZE // 2, (
            f"rank {rank} trained on {res['samples_seen']} samples in {EPOCHS} epochs, expected "
            f"{EPOCHS * TRAIN_SIZE // 2}: one pass over its shard per epoch")


def test_order_changes_every_epoch(runs):
    """Each epoch visits the samples in a new order (the sampler is told the epoch)."""
    for rank, res in runs.items():
        first, second = res["indices"][:2]
        assert first != second, (
            f"rank {rank}: epoch 1 repeats epoch 0's order: call sampler.set_epoch(epoch) at the "
            "start of every epoch, before iterating over the DataLoader")


def test_epoch_losses_are_averaged_over_ranks(runs):
    """fit reports one loss per epoch, the same on every rank (a mean over ranks), and it falls."""
    assert len(runs[0]["epoch_losses"]) == EPOCHS, (
        f"fit reported {len(runs[0]['epoch_losses'])} epoch losses for {EPOCHS} epochs")
    assert runs[0]["epoch_losses"] == pytest.approx(runs[1]["epoch_losses"], rel=1e-6), (
        f"rank 0 reported {runs[0]['epoch_losses']}, rank 1 {runs[1]['epoch_losses']}: the "
        "reported losses should be means over ranks (mean_over_ranks), hence equal on every rank")
    assert runs[0]["epoch_losses"][-1] < runs[0]["epoch_losses"][0], (
        f"the loss did not fall: {runs[0]['epoch_losses']}")


def test_batches_and_logged_losses(runs):
    """One forward per batch of local_batch_size, and each epoch's loss is the mean of its batch losses over ranks."""
    for rank, res in runs.items():
        for problem in classifier_checks(res):
            raise AssertionError(f"rank {rank}: {problem}")


def classifier_checks(res: dict) -> list[str]:
    """What the forward hook saw, against what fit reported; a list of problems (empty: fine)."""
    local = res["local_batch_size"]
    if res["forward_calls"] != res["expected_calls"]:
        return [f"{res['forward_calls']} forward passes (of {res['batch_sizes']} samples) for "
                f"{res['expected_calls']} batches of {local} samples: run the model once per "
                "batch of a DataLoader with batch_size=local_batch_size (this rank's share of the "
                "global batch) over this rank's DistributedSampler shard"]
    if res["batch_sizes"] != [local]:
        return [f"forward passes saw batches of {res['batch_sizes']} samples, expected "
                f"local_batch_size={local}"]
    for epoch, (got, want) in enumerate(zip(res["epoch_losses"], res["expected_epoch_losses"])):
        if not math.isclose(got, want, rel_tol=1e-4):
            world = res.get("world_size", 2)
            why = (f"that is {world} times it, the sum over the ranks: divide by the world size "
                   "(mean_over_ranks does)" if math.isclose(got, world * want, rel_tol=1e-3) else
                   "average this rank's batch losses over the epoch, then take the mean over "
                   "ranks (mean_over_ranks)")
            return [f"epoch {epoch}: reported loss {got:.5f}, but the mean of this epoch's batch "
                    f"losses over every rank is {want:.5f}: {why}"]
    return []


def fit_and_observe(ctx, epochs: int = EPOCHS, local_batch_size: int | None = None,
                    seed: int = 0) -> dict:
    """Train with the student's `fit` under a forward hook; report what fit returned, what the
    hook saw and the epoch losses those forward passes imply (a mean over every rank)."""
    import torch
    from torch import nn

    from helpers.bench import intra_op_threads
    from helpers.tensors import seeded
    from labs.lab03_classifier import DigitTransformer, evaluate, fit, load_digits_split

    train_set, test_set = load_digits_split(ctx.device)
    local = local_batch_size or 64 // ctx.world_size
    with seeded(0):
        model = DigitTransformer().to(ctx.device)
    outputs: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, inputs, output: outputs.append(output.detach()))
    with intra_op_threads(1):
        report = fit(model, train_set, epochs=epochs, local_batch_size=local, lr=2e-3,
                     rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, seed=seed)
    hook.remove()
    labels = train_set.tensors[1]
    batches = [seen[i:i + local] for seen in report.indices_seen for i in range(0, len(seen), local)]
    local_means = torch.full((len(report.indices_seen),), float("nan"), device=ctx.device)
    if len(outputs) == len(batches) and all(len(o) == len(b) for o, b in zip(outputs, batches)):
        k = 0
        for epoch, seen in enumerate(report.indices_seen):
            count = math.ceil(len(seen) / local)
            losses = [nn.functional.cross_entropy(outputs[k + j], labels[batches[k + j]]).item()
                      for j in range(count)]
            local_means[epoch] = sum(losses) / count
            k += count
    torch.distributed.all_reduce(local_means)  # every rank, whatever it saw: no rank is left waiting
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"test_accuracy": evaluate(model, test_set, ctx.rank, ctx.world_size), "epochs": epochs,
            "epoch_losses": report.epoch_losses, "indices": report.indices_seen[:2],
            "samples_seen": sum(len(seen) for seen in report.indices_seen),
            "params_head": params[:64].tolist(), "local_batch_size": local, "world_size": ctx.world_size,
            "forward_calls": len(outputs), "expected_calls": len(batches),
            "batch_sizes": sorted({len(o) for o in outputs}),
            "expected_epoch_losses": (local_means / ctx.world_size).tolist()}


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**fit_and_observe(ctx))
        ctx.report(done=True)
