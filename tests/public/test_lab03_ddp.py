"""Public tests of the lab 03 homework: `plan_buckets` and `BucketedDDP` (labs/lab03_ddp.py).

BucketedDDP runs on 2 real processes and is compared with one process that sees the whole global
batch (gradients every step, parameters after 4 SGD-with-momentum steps; atol 1e-6, rtol 1e-5,
float32 sums in a different order). It is also checked for what it is for: fewer collectives than
parameters, and overlap, observed from outside: hooks registered on every parameter *before* the
model is wrapped run just before BucketedDDP's own hook for that gradient, and note how many
all-reduces had been launched by then. When a gradient arrives, every bucket whose gradients had
all arrived before it must already be on its way (in bucket order); none may be waited on inside
backward, in any form: in one step rank 1 holds back its first gradient until rank 0's
`loss.backward()` has returned, which it only does if nothing inside it waits for rank 1.

Two models: an MLP, whose gradients arrive from the last parameter to the first (bucket order),
and `Detour`, registered in another order than it is applied, so that its gradients complete a
later bucket first: only launching in bucket order keeps every rank's collectives in the same
sequence.

Run:  ./run.sh check 03
"""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn

from labs.lab03_ddp import BucketedDDP, plan_buckets
from tests.harness import launch_ranks


ATOL, RTOL = 1e-6, 1e-5
SIZES = [12, 40, 40, 40, 6]   # 8 parameters: W (40, 12), b (40), ..., W (6, 40), b (6)
BUCKET_CAP_MB = 8192 / 2**20  # 8 KiB: buckets [7, 6, 5, 4, 3], [2, 1], [0]
STEPS = 4
HOLD_STEP = 1          # in this step rank 1 holds its first gradient until rank 0's backward returned
HOLD_TIMEOUT_S = 20.0  # how long rank 1 holds at most (a correct rank 0 needs milliseconds)
DETOUR_CAP_BYTES = 1360  # one bucket per layer of Detour: [5, 4] (middle), [3, 2] (last), [1, 0] (first)
DETOUR_STEPS = 2


class Detour(nn.Module):
    """Three Linear layers registered as first, last, middle and applied first -> middle -> last.

    Parameters: 0 first.weight, 1 first.bias, 2 last.weight, 3 last.bias, 4 middle.weight,
    5 middle.bias. Backward produces last's gradients, then middle's, then first's, so with one
    bucket per layer the second bucket ([3, 2]) is complete before the first ([5, 4]).
    """

    def __init__(self, seed: int):
        super().__init__()
        from helpers.tensors import seeded

        with seeded(seed):
            self.first = nn.Linear(19, 16)   # 320 elements, 1280 bytes
            self.last = nn.Linear(20, 16)    # 336 elements, 1344 bytes
            self.middle = nn.Linear(16, 20)  # 340 elements, 1360 bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def _floats(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros(shape) for shape in shapes]


def plan_hint(got: list[list[int]], num_params: int) -> str:
    """What a wrong plan most likely got wrong."""
    if any(not bucket for bucket in got):
        return ("it contains an empty bucket: close the current bucket only when it holds "
                "something; a parameter above the cap then starts a bucket and stays alone in it")
    if [i for bucket in got for i in bucket] != list(reversed(range(num_params))):
        return ("walk from the last parameter to the first, each index once: backward produces "
                "the last layer's gradient first")
    return ("sizes are bytes (Tensor.nbytes), not elements, and a bucket may reach the cap "
            "exactly: start a new one only when adding the parameter would go above it")


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_docstring_examples():
    """plan_buckets gives the docstring's examples (last parameter first, cap inclusive, 0 and huge caps)."""
    params = _floats((25,), (25,), (25,), (25,))  # 100 bytes each
    for cap, expected in ((250, [[3, 2], [1, 0]]), (200, [[3, 2], [1, 0]]), (0, [[3], [2], [1], [0]]),
                          (10**9, [[3, 2, 1, 0]])):
        got = plan_buckets(params, cap)
        assert got == expected, (
            f"four 100-byte parameters, cap {cap}: expected {expected}, got {got}: "
            f"{plan_hint(got, len(params))}")


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_mlp_layout():
    """plan_buckets splits the tests' MLP into the three buckets its 8 KiB cap implies."""
    from labs.lab03_ddp import make_mlp

    params = list(make_mlp(SIZES, seed=0).parameters())
    got = plan_buckets(params, int(BUCKET_CAP_MB * 2**20))
    assert got == [[7, 6, 5, 4, 3], [2, 1], [0]], (
        f"MLP {SIZES} with 8 KiB buckets: expected [[7, 6, 5, 4, 3], [2, 1], [0]], got {got}: "
        f"{plan_hint(got, len(params))}")


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_new_bucket_when_the_dtype_changes():
    """plan_buckets starts a new bucket where the dtype changes (one flat buffer per bucket)."""
    params = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)]
    got = plan_buckets(params, 10**6)
    assert got == [[3], [2], [1, 0]], (
        f"float32, float32, float64, float32 parameters under a huge cap: expected [[3], [2], "
        f"[1, 0]], got {got}: a bucket is one flat buffer of one dtype, so a parameter of another "
        "dtype (or device) than the bucket's starts a new bucket")


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_big_parameter_alone_and_no_empty_bucket():
    """A parameter above the cap gets a bucket of its own, and no bucket is ever empty."""
    params = _floats((10,), (10,), (500,), (10,), (500,))  # 40, 40, 2000, 40, 2000 bytes
    got = plan_buckets(params, 100)
    assert got == [[4], [3], [2], [1, 0]], (
        f"parameters of 40, 40, 2000, 40, 2000 bytes, cap 100: expected [[4], [3], [2], [1, 0]], "
        f"got {got}: {plan_hint(got, len(params))}")


@pytest.fixture(scope="module")
def launched():
    return launch_ranks(__file__, "bucketed", "detour", nproc=2, timeout=180,
                        needs=[plan_buckets, BucketedDDP])


class Case(Mapping):
    """{rank: that rank's report of one case} of the launch; reading it raises what the launch
    raised (a failure, or "not implemented yet"), inside the test that reads it."""

    def __init__(self, ranks, name: str):
        self.ranks, self.name = ranks, name

    def __getitem__(self, rank: int) -> dict:
        return self.ranks[rank][self.name]

    def __iter__(self):
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


@pytest.fixture(scope="module")
def bucketed_run(launched):
    return Case(launched, "bucketed")


@pytest.fixture(scope="module")
def detour_run(launched):
    return Case(launched, "detour")


@pytest.mark.exercise("bucketed_ddp")
def test_construction_broadcasts_rank0_parameters(bucketed_run):
    """After BucketedDDP(model), every rank holds rank 0's initial parameters."""
    for rank, res in bucketed_run.items():
        assert res["max_init_diff_vs_rank0"] == 0.0, f"rank {rank} did not start from rank 0's weights"


@pytest.mark.exercise("bucketed_ddp")
def test_gradients_equal_one_process_with_the_global_batch(bucketed_run):
    """After finish_gradient_synchronization, every step's gradients equal one process's on the global batch."""
    for rank, res in bucketed_run.items():
        right = [diff <= ATOL + RTOL * scale for diff, scale in zip(res["grad_diffs"], res["grad_scales"])]
        for step, (diff, ratio) in enumerate(zip(res["grad_diffs"], res["grad_norm_ratios"])):
            if right[step]:
                continue
            if abs(ratio - res["world_size"]) < 0.05:
                hint = "that is the ranks' sum, not their mean: divide by the world size"
            elif step > 0 and right[0]:
                hint = ("step 0 was right, so some per-step state carries over into the next "
                        "backward: reset num_ready, work and next_bucket in "
                        "finish_gradient_synchronization, and copy each step's gradient into "
                        "the buffer afresh")
            else:
                hint = ("is each bucket waited on (.wait()) before its buffer is read, and is "
                        "every slice copied back into its own parameter's .grad?")
            raise AssertionError(
                f"rank {rank} step {step}: gradients differ from one process on the global batch "
                f"by {diff:g} (their norm is {ratio:.3g} times the reference's): {hint}")


@pytest.mark.exercise("bucketed_ddp")
def test_parameters_after_steps_equal_one_process(bucketed_run):
    """After 4 SGD steps the parameters equal one process's and are identical on both ranks."""
    for rank, res in bucketed_run.items():
        assert res["max_param_diff_vs_reference"] <= ATOL, (
            f"rank {rank}: parameters after {STEPS} steps differ by "
            f"{res['max_param_diff_vs_reference']:g}")
    assert bucketed_run[0]["params_head"] == bucketed_run[1]["params_head"], \
        "the ranks' parameters are not identical"


@pytest.mark.exercise("bucketed_ddp")
def test_fewer_collectives_than_parameters(bucketed_run):
    """One all-reduce per bucket per step, carrying every gradient byte once: fewer than one per parameter."""
    res = bucketed_run[0]
    assert res["num_buckets"] == 3, f"expected the 3 buckets plan_buckets makes, BucketedDDP has {res['num_buckets']}"
    assert res["collectives_per_step"] == [res["num_buckets"]] * STEPS, (
        f"all-reduces per step: {res['collectives_per_step']}; expected one per bucket "
        f"({res['num_buckets']}) in every step")
    assert max(res["collectives_per_step"]) < res["num_params"]
    assert res["bytes_per_step"] == [res["param_bytes"]] * STEPS, (
        f"bytes all-reduced per step: {res['bytes_per_step']}; each step should all-reduce every "
        f"gradient byte exactly once ({res['param_bytes']})")


@pytest.mark.exercise("bucketed_ddp")
def test_all_reduces_launched_before_backward_returns(bucketed_run):
    """Every step launches its all-reduces asynchronously from inside backward and waits on none there."""
    for rank, res in bucketed_run.items():
        assert min(res["launched_during_backward"]) >= 1, (
            f"rank {rank}: no all-reduce was launched before loss.backward() returned: "
            "launch them from the gradient hooks")
        assert max(res["waited_during_backward"]) == 0, (
            f"rank {rank}: an all-reduce was waited on inside backward: that removes the overlap")
        assert res["blocking_all_reduces"] == 0, f"rank {rank}: launch the all-reduces with async_op=True"


@pytest.mark.exercise("bucketed_ddp")
def test_backward_does_not_wait_for_the_other_ranks(bucketed_run):
    """Backward returns without waiting for any all-reduce to complete (no wait or spin inside the hooks)."""
    res = bucketed_run[1]
    assert res["rank0_backward_returned_while_held"], (
        f"in step {HOLD_STEP} rank 1 held back its first gradient for {HOLD_TIMEOUT_S:g} s, "
        "before launching any all-reduce, and rank 0's loss.backward() did not return in that "
        "time: something inside rank 0's backward waits for an all-reduce to complete (a "
        ".wait(), a loop on work.is_completed(), async_op=False...), so it waits for rank 1. "
        "That is a synchronous all-reduce in disguise: nothing overlaps. Launch with "
        "async_op=True, return, and wait only in finish_gradient_synchronization")


@pytest.mark.exercise("bucketed_ddp")
def test_finish_waits_on_every_bucket(bucketed_run):
    """finish_gradient_synchronization waits (.wait()) on each bucket's all-reduce, once per step."""
    for rank, res in bucketed_run.items():
        assert res["waits_per_step"] == [res["num_buckets"]] * STEPS, (
            f"rank {rank}: waits per step {res['waits_per_step']}, expected one per bucket "
            f"({res['num_buckets']}): finish_gradient_synchronization must call .wait() on every "
            "bucket's handle before it reads the bucket's buffer (an async all-reduce may still "
            "be running; on CUDA, wait() also orders the stream after it)")


@pytest.mark.exercise("bucketed_ddp")
def test_earlier_buckets_are_on_their_way_when_the_last_gradient_arrives(bucketed_run):
    """When the step's last gradient arrives, the earlier buckets have already been launched."""
    for rank, res in bucketed_run.items():
        for step, arrivals in enumerate(res["arrivals"]):
            last_param, launched = arrivals[-1]
            assert launched >= 1, (
                f"rank {rank} step {step}: when the step's last gradient (parameter {last_param}) "
                "arrived, no all-reduce had been launched yet: buckets must go out from "
                "_on_grad_ready as soon as they are complete, not all at the end of backward "
                "(then nothing overlaps)")


@pytest.mark.exercise("bucketed_ddp")
def test_each_bucket_launched_as_soon_as_it_is_complete(bucketed_run):
    """Each bucket's all-reduce starts right after its last gradient is copied in, in bucket order."""
    for rank, res in bucketed_run.items():
        for step, arrivals in enumerate(res["arrivals"]):
            check_launches(arrivals, res["buckets"], f"rank {rank} step {step}")


@pytest.mark.exercise("bucketed_ddp")
def test_buckets_launch_in_bucket_order_when_gradients_arrive_out_of_order(detour_run):
    """A model whose gradients complete a later bucket first: buckets still launch in bucket order."""
    for rank, res in detour_run.items():
        assert res["buckets"] == [[5, 4], [3, 2], [1, 0]], (
            f"rank {rank}: Detour's buckets with a {DETOUR_CAP_BYTES}-byte cap should be "
            f"[[5, 4], [3, 2], [1, 0]], got {res['buckets']}")
        for step, launched in enumerate(res["launched_numels_per_step"]):
            if sorted(launched) == sorted(res["bucket_numels"]):
                assert launched == res["bucket_numels"], (
                    f"rank {rank} step {step}: all-reduced sizes {launched} (elements), in this "
                    f"order; the buckets, in bucket order, are {res['bucket_numels']}: a bucket "
                    "that completed early was launched before the buckets ahead of it. Launch "
                    "only in bucket order (self.next_bucket): every rank must issue its "
                    "all-reduces in the same sequence, and when gradients arrive in another order "
                    "on another rank, launching each bucket as soon as it is full pairs different "
                    "buckets across ranks")
        for step, arrivals in enumerate(res["arrivals"]):
            check_launches(arrivals, res["buckets"], f"Detour, rank {rank} step {step}")
        for step, launched in enumerate(res["launched_numels_per_step"]):
            assert launched == res["bucket_numels"], (
                f"Detour, rank {rank} step {step}: all-reduced sizes {launched} (elements); "
                f"expected one all-reduce per bucket, in bucket order: {res['bucket_numels']}")
        for step, (diff, scale) in enumerate(zip(res["grad_diffs"], res["grad_scales"])):
            assert diff <= ATOL + RTOL * scale, (
                f"Detour, rank {rank} step {step}: gradients differ from one process by {diff:g}")


def check_launches(arrivals: list, buckets: list[list[int]], where: str) -> None:
    """At each gradient's arrival, the all-reduces launched so far must be exactly the buckets
    complete before it, counted in bucket order."""
    for k, (param, launched) in enumerate(arrivals):
        expected = complete_leading_buckets(buckets, [p for p, _ in arrivals[:k]])
        if launched > expected:
            raise AssertionError(
                f"{where}: when the gradient of parameter {param} arrived, {launched} all-reduce(s) "
                f"had been launched but only {expected} bucket(s) were complete counted in bucket "
                f"order (buckets {buckets}, gradients so far {[p for p, _ in arrivals[:k]]}): a "
                "bucket went out before one ahead of it was complete, or before its own last "
                "gradient. Launch bucket self.next_bucket, then the next, only while each is complete")
        assert launched == expected, (
            f"{where}: when the gradient of parameter {param} arrived, {expected} bucket(s) were "
            f"complete (in bucket order) but {launched} all-reduce(s) had been launched: launch "
            "each bucket, in order, right after its last gradient is copied in (and every complete "
            "bucket after it), not later")


def complete_leading_buckets(buckets: list[list[int]], arrived: list[int]) -> int:
    """How many buckets, counted in bucket order, have all their parameters in `arrived`."""
    count = 0
    for bucket in buckets:
        if not set(bucket) <= set(arrived):
            break
        count += 1
    return count


def observe_arrivals(model, state: dict, on_first=None) -> list:
    """Hooks registered before wrapping (so each runs just before the wrapper's hook for the same
    gradient): (parameter index, all-reduces launched so far this step) per arriving gradient.
    `on_first()`, if given, runs at the step's first arrival, before the wrapper sees it."""
    arrivals: list[tuple[int, int]] = []

    def note(index: int) -> None:
        if not arrivals and on_first is not None:
            on_first()
        arrivals.append((index, state["ddp"].comm.collectives - state["start"]))

    for index, param in enumerate(model.parameters()):
        param.register_post_accumulate_grad_hook(lambda p, index=index: note(index))
    return arrivals


class HoldBack:
    """Rank `holder` holds its first gradient of a chosen step until rank `waited_for`'s
    loss.backward() has returned (or `timeout_s` passes), through the process group's store: a
    backward that waits for an all-reduce inside cannot return while the holder has launched none."""

    def __init__(self, step: int, holder: int, waited_for: int, timeout_s: float, tag: str):
        import torch.distributed as dist

        self.store = dist.distributed_c10d._get_default_store()
        self.step, self.holder, self.waited_for = step, holder, waited_for
        self.timeout_s, self.tag = timeout_s, tag
        self.current_step = -1
        self.released: bool | None = None  # on the holder: did the other backward return in time

    def on_first_gradient(self, rank: int) -> None:
        import datetime

        if rank != self.holder or self.current_step != self.step:
            return
        try:
            self.store.wait([self._key()], datetime.timedelta(seconds=self.timeout_s))
            self.released = True
        except Exception:  # the store's timeout error
            self.released = False

    def backward_returned(self, rank: int) -> None:
        if rank == self.waited_for and self.current_step == self.step:
            self.store.set(self._key(), "1")

    def _key(self) -> str:
        return f"hold/{self.tag}/{self.step}"


def train_against_reference(ddp, model, reference, rank: int, world_size: int, steps: int, sizes,
                            local_batch_size: int, state: dict | None = None, arrivals: list | None = None,
                            hold: HoldBack | None = None) -> dict:
    """`steps` SGD steps of `ddp` on shard `rank` of `world_size` (ranks of ddp's group) next to
    one process on the global batch; what each step launched, waited on and sent, and how far the
    gradients are from one process. `state` and `arrivals` come from `observe_arrivals`."""
    from labs.lab03_ddp import flat_grads, flat_params, global_batch, local_shard

    out = {k: [] for k in ("grad_diffs", "grad_scales", "grad_norm_ratios", "collectives_per_step",
                           "bytes_per_step", "launched_during_backward", "waited_during_backward",
                           "waits_per_step", "launched_numels_per_step", "arrivals")}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, local_batch_size * world_size, sizes[0], sizes[-1])
        opt.zero_grad(set_to_none=True)  # .grad tensors are new each step
        loss = nn.functional.mse_loss(ddp(local_shard(x, rank, world_size)), local_shard(y, rank, world_size))
        launched, waited, sent = ddp.comm.collectives, ddp.comm.waits, ddp.comm.bytes
        first = len(ddp.comm.launched_numels)
        if state is not None:
            state["start"] = launched
            arrivals.clear()
        if hold is not None:
            hold.current_step = step
        loss.backward()
        if hold is not None:
            hold.backward_returned(rank)
        if arrivals is not None:
            out["arrivals"].append(list(arrivals))
        out["launched_during_backward"].append(ddp.comm.collectives - launched)
        out["waited_during_backward"].append(ddp.comm.waits - waited)
        ddp.finish_gradient_synchronization()
        out["collectives_per_step"].append(ddp.comm.collectives - launched)
        out["waits_per_step"].append(ddp.comm.waits - waited)
        out["bytes_per_step"].append(ddp.comm.bytes - sent)
        out["launched_numels_per_step"].append(ddp.comm.launched_numels[first:])
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        out["grad_diffs"].append((flat_grads(model) - flat_grads(reference)).abs().max().item())
        out["grad_scales"].append(flat_grads(reference).abs().max().item())
        out["grad_norm_ratios"].append((flat_grads(model).norm() / flat_grads(reference).norm()).item())
        opt.step()
        ref_opt.step()
    out["max_param_diff_vs_reference"] = (flat_params(model) - flat_params(reference)).abs().max().item()
    out["params_head"] = flat_params(model)[:32].tolist()
    out["blocking_all_reduces"] = ddp.comm.blocking
    return out


def wrap_and_train(model, reference, rank: int, world_size: int, bucket_cap_mb: float, steps: int,
                   sizes, local_batch_size: int, group=None, hold: HoldBack | None = None) -> dict:
    """Registers the observers (`observe_arrivals`, `hold` at the first gradient), wraps `model` in
    BucketedDDP over `group` (rank `rank` of `world_size` in it) and trains it next to `reference`,
    which starts from the group's first rank's initialisation: the buckets, how far the wrapped
    model starts from the reference, and `train_against_reference`'s report."""
    from labs.lab03_ddp import flat_params

    state = {"ddp": None, "start": 0}
    on_first = None if hold is None else (lambda: hold.on_first_gradient(rank))
    arrivals = observe_arrivals(model, state, on_first=on_first)
    ddp = state["ddp"] = BucketedDDP(model, bucket_cap_mb=bucket_cap_mb, group=group)  # after: ours run first
    params = list(model.parameters())
    out = {"max_init_diff_vs_rank0": (flat_params(model) - flat_params(reference)).abs().max().item(),
           "num_buckets": len(ddp.buckets), "num_params": len(params),
           "param_bytes": sum(p.nbytes for p in params), "world_size": world_size,
           "buckets": [b.param_indices for b in ddp.buckets],
           "bucket_numels": [sum(params[i].numel() for i in b.param_indices) for b in ddp.buckets]}
    out.update(train_against_reference(ddp, model, reference, rank, world_size, steps, sizes,
                                       local_batch_size, state=state, arrivals=arrivals, hold=hold))
    out["collectives"] = ddp.comm.collectives
    return out


def bucketed_case(ctx) -> dict:
    from labs.lab03_ddp import make_mlp

    hold = HoldBack(HOLD_STEP, holder=1, waited_for=0, timeout_s=HOLD_TIMEOUT_S, tag="mlp")
    out = wrap_and_train(make_mlp(SIZES, seed=100 + ctx.rank),  # a different initialisation on every rank
                         make_mlp(SIZES, seed=100),             # rank 0's initialisation, one process
                         ctx.rank, ctx.world_size, BUCKET_CAP_MB, STEPS, SIZES, local_batch_size=8, hold=hold)
    out["rank0_backward_returned_while_held"] = hold.released
    return out


def detour_case(ctx) -> dict:
    return wrap_and_train(Detour(seed=200 + ctx.rank), Detour(seed=200), ctx.rank, ctx.world_size,
                          DETOUR_CAP_BYTES / 2**20, DETOUR_STEPS, [19, 16], local_batch_size=4)


if __name__ == "__main__":
    import sys

    from helpers.dist import distributed

    with distributed() as ctx:
        cases = {"bucketed": bucketed_case, "detour": detour_case}
        for name in sys.argv[1:]:
            ctx.report(**{name: cases[name](ctx)})
            ctx.barrier()
        ctx.report(done=True)
