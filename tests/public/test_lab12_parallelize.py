"""Public tests of lab 12's exercises, `parallelize` and `clip_grad_norm_`
(labs/lab12_parallelize.py).

Run:  ./run.sh check 12      (or: .venv/bin/python -m pytest tests/public/test_lab12_parallelize.py)

One launch on 4 ranks (gloo on the CPU, or nccl with 4 GPUs) runs every case; this file is also
its worker. Each `parallelize` case builds a small ByteLM on the meta device (a pipeline stage of
it where the mesh has pp > 1), calls parallelize on a (pp, dp, tp) mesh of the 4 ranks,
materialises it (`to_empty`, `init_weights`) and records what each rank holds (every parameter's
mesh, placements and local size, the FSDP units), what the norms and linear layers see in the
first forward (input shapes, dtypes), the logits, what the forward keeps for the backward, and
the collectives of a step by mesh dimension; then it trains a few AdamW steps (no clipping) and
compares losses and parameters with one process that trained the whole model on the whole
batches. Each `clip_grad_norm_` case gives every rank DTensor gradients of known full values
(sharded over a (dp, tp) mesh, some stages of a pipeline each holding their own parameters) and
compares the returned norm and the clipped gradients with the whole model's.
"""
from __future__ import annotations

import math
import sys
import traceback

import pytest
import torch

from helpers.notice import Unsolved, stub_message
from labs.lab12_parallelize import clip_grad_norm_, parallelize
from tests.harness import launch_ranks

NPROC = 4
LOSS_RTOL, PARAM_ATOL = 1e-4, 1e-4          # float32 against one process (labs/lab12_train.py)
BF16_LOSS_RTOL = 3e-2                        # bf16 parameters: 8 bits of mantissa
NORM_RTOL = 1e-5
TINY = dict(dim=32, heads=4, layers=2, ffn=64, seq=16, batch=4, lr=3e-3)
# name: (pp, dp, tp), options
CASES = {
    "dp2 x tp2": ((1, 2, 2), {}),
    "pp2 x tp2": ((2, 1, 2), {}),
    "dp2 x tp2, whole logits": ((1, 2, 2), {"loss_parallel": False}),
    "dp2 x tp2, checkpointing": ((1, 2, 2), {"activation_checkpointing": True}),
    "dp2 x tp2, bf16": ((1, 2, 2), {"bf16": True}),
}
# name: (pp, dp, tp), max_norm as a multiple of the whole gradient's norm, stages without grads
CLIP_CASES = {
    "dp2 x tp2, clipped": ((1, 2, 2), 0.1, ()),
    "dp2 x tp2, below max_norm": ((1, 2, 2), 10.0, ()),
    "pp2 x tp2, clipped": ((2, 1, 2), 0.2, ()),
    "pp2 x dp2, clipped": ((2, 2, 1), 0.2, ()),
    "pp2 x tp2, a stage without gradients": ((2, 1, 2), 0.2, (1,)),
}


# ======================================================================== parallelize, one case
def run_case(shape, *, config: dict | None = None, loss_parallel: bool = True, bf16: bool = False,
             activation_checkpointing: bool = False, steps: int = 2, microbatches: int = 2) -> dict:
    """One parallelize case on this rank: what it holds and sees, and training vs one process."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from labs.lab12_model import LMConfig, build_model, canonical_name, corpus, train_reference
    from labs.lab12_parallelize import MESH_DIMS, make_mesh, pipeline_stage

    cfg = LMConfig(**{**TINY, **(config or {}), "max_norm": math.inf})
    pp, dp, tp = shape
    device = _device()
    mesh = make_mesh(shape, device.type)
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in MESH_DIMS)
    rep: dict = {"shape": list(shape), "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": tp_rank,
                 "rank": dist.get_rank(), "seq": cfg.seq, "layers": cfg.layers,
                 "dp_tp_ranks": sorted(int(r) for r in mesh["dp", "tp"].mesh.flatten().tolist()),
                 "tp_ranks": sorted(int(r) for r in mesh["tp"].mesh.flatten().tolist()),
                 "dp_ranks": sorted(int(r) for r in mesh["dp"].mesh.flatten().tolist())}
    model = pipeline_stage(build_model(cfg), pp_rank, pp)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    error = None
    try:
        returned = parallelize(model, mesh, loss_parallel=loss_parallel, mp_policy=policy,
                               activation_checkpointing=activation_checkpointing)
        model = returned if returned is not None else model
    except Exception as err:
        error = _error("parallelize", err)
    if error is None:
        try:
            model.to_empty(device=device)
            model.init_weights()
        except Exception as err:
            error = _error("materialising the parallelised model (to_empty, init_weights)", err)
    if not _agree(error is None):   # no rank goes on to talk to a rank that stopped
        return {**rep, "error": error or "parallelize failed on another rank (its report says why)"}
    params = {}
    for name, p in model.named_parameters():
        entry = {"dtensor": hasattr(p, "device_mesh"), "global": p.numel(), "local": p.numel(),
                 "dims": [], "placements": [], "mesh_ranks": [dist.get_rank()]}
        if entry["dtensor"]:
            entry.update(local=p.to_local().numel(), dims=list(p.device_mesh.mesh_dim_names or ()),
                         placements=[repr(pl) for pl in p.placements],
                         mesh_ranks=sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist()))
        params[canonical_name(name)] = entry
    rep["params"] = params
    rep["fsdp_units"] = sorted(canonical_name(n) for n, m in model.named_modules() if isinstance(m, FSDPModule))
    rep["blocks"] = sorted(model.layers.keys())

    seen: dict = {"norm_inputs": {}, "linear_dtypes": {}}

    def norm_input(name):
        def hook(module, args):     # a pre-hook that returns None leaves the inputs alone
            seen["norm_inputs"].setdefault(name, list(_local(args[0]).shape))
        return hook

    def linear_dtypes(name):
        def hook(module, args):
            seen["linear_dtypes"].setdefault(name, [str(_local(args[0]).dtype).replace("torch.", ""),
                                                    str(_local(module.weight).dtype).replace("torch.", "")])
        return hook

    hooks = []
    for name, module in model.named_modules():
        name = canonical_name(name)
        if isinstance(module, nn.RMSNorm):
            hooks.append(module.register_forward_pre_hook(norm_input(name)))
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(linear_dtypes(name)))
    try:
        rep.update(_train(model, mesh, cfg, shape, device, loss_parallel, steps, microbatches))
    except Exception as err:
        error = _error("training the parallelised model", err)
    finally:
        for h in hooks:
            h.remove()
    if not _agree(error is None):   # what it holds is still reported: the placement tests read it
        return {**rep, "train_error": error or "training failed on another rank (its report says why)"}
    rep.update(seen)
    data = corpus(300_000)
    reference = train_reference(cfg, steps, data, device=device)
    ref = {n: p.detach().float().cpu() for n, p in reference["model"].named_parameters()}
    try:
        mine = {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                for n, p in model.named_parameters()}
        rep["param_diff"] = max((mine[n] - ref[n]).abs().max().item() for n in mine)
    except Exception as err:
        error = _error("gathering the trained parameters (full_tensor)", err)
    if not _agree(error is None):
        return {**rep, "train_error": error or "gathering the parameters failed on another rank"}
    rep["reference_losses"] = reference["losses"]
    return rep


def _train(model, mesh, cfg, shape, device, loss_parallel, steps, microbatches) -> dict:
    """AdamW steps on this rank's part, no clipping; losses on every rank; the first forward's
    logits, saved activations and one step's collectives recorded."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    from helpers.memory import SavedTensorBytes
    from helpers.traffic import TrafficMeter
    from labs.lab12_model import batch_at, corpus, lm_loss

    pp, dp, tp = shape
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    rows = cfg.batch // dp
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = corpus(300_000)
    context = loss_parallel_context if loss_parallel else contextlib.nullcontext
    schedule = None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(model, pp_rank, pp, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lm_loss, scale_grads=True)
    out: dict = {"losses": []}
    for step in range(steps):
        x, y = (t[dp_rank * rows:(dp_rank + 1) * rows].to(device) for t in batch_at(data, step, cfg.batch, cfg.seq))
        traffic = TrafficMeter(mesh) if step == 1 else contextlib.nullcontext()
        with traffic, context():
            if schedule is None:
                saved = SavedTensorBytes(skip_parameters=True) if step == 0 else contextlib.nullcontext()
                with saved:
                    logits = model(x)
                if step == 0:
                    out["saved_bytes"] = saved.bytes
                    out["logits"] = {"dtensor": hasattr(logits, "placements"),
                                     "placements": [repr(p) for p in getattr(logits, "placements", ())],
                                     "local_shape": list(_local(logits).shape), "global_shape": list(logits.shape)}
                loss = lm_loss(logits, y)
                loss.backward()
                value = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().float()
            else:
                losses: list = []
                if pp_rank == 0:
                    schedule.step(x)
                elif pp_rank == pp - 1:
                    schedule.step(target=y, losses=losses)
                else:
                    schedule.step()
                value = torch.stack([(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float()
                                     for v in losses]).mean() if losses else None
            optimizer.step()
            optimizer.zero_grad()
        if step == 1:
            out["traffic"] = traffic.summary()
        value = value if value is not None else torch.zeros((), device=device)
        if dp > 1 and (schedule is None or pp_rank == pp - 1):
            dist.all_reduce(value, group=mesh["dp"].get_group())
            value /= dp
        if pp > 1:
            dist.all_reduce(value, group=mesh["pp"].get_group())
        out["losses"].append(value.item())
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _device() -> torch.device:
    """This rank's device: its GPU under nccl, else the CPU (helpers.dist chose the backend)."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


_AGREEMENT: dict = {}


def _agree(ok: bool) -> bool:
    """True on every rank if `ok` on every rank: a sync point of all ranks, so that after a rank
    fails none goes on into a collective the failed one will not join. Its own gloo group waits
    three times the process-group timeout: a rank stuck in a collective of the failed case joins
    once that collective has timed out."""
    import datetime

    import torch.distributed as dist

    from helpers.dist import timeout_seconds

    if "group" not in _AGREEMENT:
        _AGREEMENT["group"] = dist.new_group(backend="gloo",
                                             timeout=datetime.timedelta(seconds=3 * timeout_seconds()))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_AGREEMENT["group"])
    return bool(flag.item())


def _error(what: str, err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/labs/" in f.filename]
    where = f" (at labs/{frames[-1].filename.split('/labs/')[-1]}:{frames[-1].lineno})" if frames else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{what} raised {type(err).__name__}: {first[:400]}{where}"


# ==================================================================== clip_grad_norm_, one case
CLIP_PARAMS = {   # name: (full shape, placements on the (dp, tp) mesh, pipeline stage)
    "a": ((8, 6), ("Shard(0)", "Shard(1)"), 0),
    "b": ((6, 8), ("Shard(0)", "Replicate()"), 0),
    "c": ((8,), ("Replicate()", "Shard(0)"), 0),
    "d": ((4, 4), ("Shard(1)", "Shard(0)"), 1),
    "e": ((8,), ("Shard(0)", "Replicate()"), 1),
    "f": ((3,), None, 1),                           # a plain tensor (every rank the same)
    "g": ((6, 4), ("Shard(0)", "Shard(0)"), 1),
}


def clip_case(shape, factor: float, no_grad_stages=(), seed: int = 0, params=CLIP_PARAMS) -> dict:
    """Gradients of known full values on a (pp, dp, tp) mesh; clip_grad_norm_ on this rank's
    stage; its norm and its gradients against the whole model's."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor, Replicate, Shard  # noqa: I001

    from labs.lab12_parallelize import make_mesh

    pp = shape[0]
    device = _device()
    mesh = make_mesh(shape, device.type)
    pp_rank = mesh["pp"].get_local_rank()
    grid = mesh["dp", "tp"]
    generator = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=generator).to(device) for n, (s, _, _) in params.items()}
    have_grads = {n for n, (_, _, st) in params.items() if st % pp not in no_grad_stages}
    norm = math.sqrt(sum(full[n].double().pow(2).sum().item() for n in have_grads))
    max_norm = factor * norm
    coef = min(1.0, max_norm / (norm + 1e-6))
    mine = {}
    for n, (s, placements, st) in params.items():
        if st % pp != pp_rank:
            continue
        value = torch.zeros(s, device=device)
        if placements is None:
            p = torch.nn.Parameter(value)
            if n in have_grads:
                p.grad = full[n].clone()
        else:
            pl = [Shard(int(x[6:-1])) if x.startswith("Shard") else Replicate() for x in placements]
            p = torch.nn.Parameter(distribute_tensor(value, grid, pl))
            if n in have_grads:
                p.grad = distribute_tensor(full[n], grid, pl)
        mine[n] = p
    rep = {"shape": list(shape), "pp_rank": pp_rank, "rank": dist.get_rank(), "norm": norm,
           "max_norm": max_norm, "coef": coef}
    error = None
    try:
        total = clip_grad_norm_(list(mine.values()), max_norm,
                                mesh["pp"].get_group() if pp > 1 else None)
    except Exception as err:
        error = _error("clip_grad_norm_", err)
    if not _agree(error is None):
        return {**rep, "error": error or "clip_grad_norm_ failed on another rank (its report says why)"}
    rep["returned"] = {"type": type(total).__name__, "dtensor": hasattr(total, "placements"),
                       "shape": list(getattr(total, "shape", [None])), "dtype": str(getattr(total, "dtype", ""))}
    value = total.full_tensor() if hasattr(total, "full_tensor") else total
    rep["total"] = float(value)
    grad_errors = {}
    for n, p in mine.items():
        if n not in have_grads:
            grad_errors[n] = 0.0 if p.grad is None else float(_full(p.grad).abs().max())
            continue
        got = _full(p.grad)
        grad_errors[n] = (got.double() - full[n].double() * coef).abs().max().item()
    rep["grad_errors"] = grad_errors
    rep["scale"] = max(full[n].abs().max().item() for n in have_grads)
    return rep


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while both exercises are still stubs (the worker runs
    the cases of the exercises that are written)."""
    both = [parallelize, clip_grad_norm_]
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=280, env={"DIST_TIMEOUT": "30"},
                        needs=both if all(stub_message(f) for f in both) else [])


def require(exercise) -> None:
    """A test of an exercise that is still its stub is "not implemented yet"."""
    message = stub_message(exercise)
    if message:
        raise Unsolved(message)


def case(results, name: str, trained: bool = True) -> list[dict]:
    """Every rank's report of one parallelize case. A case whose parallelize failed fails here;
    one whose training failed fails here only when the test needs the training (`trained`)."""
    require(parallelize)
    reps = [results[rank]["cases"][name] for rank in range(NPROC)]
    for key in ("error", "train_error") if trained else ("error",):
        failed = [rep for rep in reps if key in rep]
        if failed:
            rep = first_cause(failed, key)
            pytest.fail(f"rank {rep['rank']} ({name}, mesh pp x dp x tp = {' x '.join(map(str, rep['shape']))}): "
                        f"{rep[key]}.{hints(name, rep[key])}")
    return reps


def first_cause(reps: list[dict], key: str) -> dict:
    """The report whose error is a cause, not a consequence (a peer that timed out waiting for
    the failed rank, or heard that it failed)."""
    consequences = ("Timed out", "Connection closed", "on another rank", "Connection reset")
    return next((r for r in reps if not any(c in r[key] for c in consequences)), reps[0])


def hints(name: str, error: str) -> str:
    """What an error in a case most likely means."""
    out = ""
    if "mixed torch.Tensor and DTensor" in error and "nll_loss" not in error:
        out += (" A layer met a DTensor and a plain tensor: a module on the path of the "
                "tensor-parallel activations was left out of the plan (the norms: SequenceParallel(); "
                "the output layer: ColwiseParallel(input_layouts=Shard(1), ...)), or its input "
                "layout does not match what the previous layer returns.")
    if error.startswith("parallelize raised") and any(
            word in error for word in ("DTensor", "mesh", "Mesh", "placement", "fully_shard", "FSDP")):
        out += (" Apply tensor parallelism first (parallelize_module on mesh['tp']), then "
                "checkpointing, then fully_shard(..., mesh=mesh['dp']) per block and at the root: "
                "fully_shard without mesh= shards over every rank, which torch refuses for "
                "parameters that are already DTensors on mesh['tp'].")
    if "whole logits" in name and "nll_loss" in error:
        out += (" With loss_parallel=False the caller computes a plain cross-entropy, outside "
                "loss_parallel(): the logits must be a plain tensor, whole over the vocabulary "
                "(output_layouts=Replicate(), use_local_output=True).")
    if name.startswith("pp"):
        out += (" This mesh has a pipeline: the model is one stage of it (tok_embeddings, norm or "
                "output may be None, and only some blocks are left in model.layers): plan only "
                "what is there.")
    return out


def clip(results, name: str) -> list[dict]:
    require(clip_grad_norm_)
    reps = [results[rank]["clip"][name] for rank in range(NPROC)]
    failed = [rep for rep in reps if "error" in rep]
    if failed:
        rep = first_cause(failed, "error")
        pytest.fail(f"rank {rep['rank']} ({name}): {rep['error']}")
    return reps


SP = ("With sequence parallelism the activations between the layers are split along the sequence, "
      "so every RMSNorm must run on its rank's t / tp positions: SequenceParallel() on each norm, "
      "the embedding's output and each row-parallel layer's output split along the sequence "
      "(output_layouts=Shard(1)), and each attention and MLP gathering the whole sequence at its "
      "input (PrepareModuleInput, or input_layouts=Shard(1) on the column-parallel layers).")


def matrices(rep: dict) -> dict[str, dict]:
    return {n: e for n, e in rep["params"].items() if not n.endswith("norm.weight")}


def kept_next_to(results, name: str, plain: str) -> list[tuple[dict, int]]:
    """(report, bytes the same rank kept for the backward in case `plain`) for each rank of case `name`."""
    kept = {rep["rank"]: rep["saved_bytes"] for rep in case(results, plain)}
    return [(rep, kept[rep["rank"]]) for rep in case(results, name)]


def not_in_bf16(rep: dict) -> dict[str, list]:
    """The linear layers that computed with weights of another dtype than bfloat16."""
    return {n: d for n, d in rep["linear_dtypes"].items() if d[1] != "bfloat16"}


# ----------------------------------------------------------------------- parallelize: placements
@pytest.mark.exercise("parallelize")
def test_every_parameter_is_split_over_dp_and_tp_only(results):
    """Each matrix is split over the tp ranks and again over the dp ranks only: 1/(dp tp) per rank."""
    for rep in case(results, "dp2 x tp2", trained=False):
        allowed = set(rep["dp_tp_ranks"])
        for name, e in rep["params"].items():
            assert e["dtensor"], (
                f"rank {rep['rank']}: {name} is a plain tensor: after parallelize every parameter is "
                "a DTensor (tensor parallelism makes the matrices DTensors on mesh['tp'], fully_shard on "
                "mesh['dp'] makes every parameter one)")
            outside = sorted(set(e["mesh_ranks"]) - allowed)
            assert not outside, (
                f"rank {rep['rank']}: {name} is sharded over ranks {e['mesh_ranks']}, which include "
                f"{outside} outside this rank's dp x tp group {sorted(allowed)}")
            assert set(e["dims"]) <= {"dp", "tp"} and "dp" in e["dims"], (
                f"rank {rep['rank']}: {name} lives on a mesh with dimensions {e['dims']} "
                f"(placements {e['placements']}), not split over mesh['dp']: FSDP shards every "
                "parameter over the data-parallel sub-mesh, fully_shard(module, mesh=mesh['dp']) on "
                "each block and on the model (without mesh=, fully_shard would use every rank)")
        for name, e in matrices(rep).items():
            assert e["local"] * 4 == e["global"], (
                f"rank {rep['rank']}: holds {e['local']} of {name}'s {e['global']} elements "
                f"(placements {e['placements']} on {e['dims']}); with dp 2 x tp 2 each rank holds a "
                "quarter: tensor parallelism splits it over the 2 tp ranks, FSDP splits each of those "
                "halves over the 2 dp ranks. "
                + ("Half: one of the two is missing (FSDP over mesh['dp'] per block and at the root, "
                   "or the matrix left out of the tensor-parallel plan)." if e["local"] * 2 == e["global"]
                   else "FSDP over every rank splits each tp shard across its tp peers too: use mesh['dp']."))


@pytest.mark.exercise("parallelize")
def test_norm_weights_are_replicated_over_tp(results):
    """Every RMSNorm weight is a DTensor replicated over the tp ranks and split over dp: 1/dp per rank."""
    for rep in case(results, "dp2 x tp2", trained=False):
        norms = {n: e for n, e in rep["params"].items() if n.endswith("norm.weight")}
        assert norms, "no norm weights found"
        for name, e in norms.items():
            assert "dp" in e["dims"], (
                f"rank {rep['rank']}: {name} is on a mesh with dimensions {e['dims']}, not split over "
                "mesh['dp']: FSDP (fully_shard(..., mesh=mesh['dp'])) shards the norms' weights too")
            assert "tp" in e["dims"], (
                f"rank {rep['rank']}: {name} is on a mesh with dimensions {e['dims']}, not on (dp, tp): "
                "the norms must be part of the tensor-parallel plan (SequenceParallel()). Left out, "
                "a norm either sees the whole sequence on every tp rank (no sequence parallelism: "
                "tp times the activations), or runs as a plain module on its rank's sequence shard, "
                "and then its weight's gradient only sums over this rank's tokens")
            assert e["local"] * 2 == e["global"], (
                f"rank {rep['rank']}: holds {e['local']} of {name}'s {e['global']} elements: "
                "replicated over tp, split over the 2 dp ranks by FSDP")


@pytest.mark.exercise("parallelize")
def test_fsdp_unit_per_block_and_root(results):
    """fully_shard is applied to every block and to the model itself."""
    for rep in case(results, "dp2 x tp2", trained=False):
        units = set(rep["fsdp_units"])
        missing = [f"layers.{k}" for k in rep["blocks"] if f"layers.{k}" not in units]
        assert "" in units, (f"rank {rep['rank']}: the model itself is not an FSDP module: "
                             "fully_shard(model, mesh=mesh['dp']) last, after the blocks")
        assert not missing, (
            f"rank {rep['rank']}: blocks {missing} are not FSDP units (units: {sorted(units)}): with "
            "one unit at the root, the whole model's parameters are gathered at once; fully_shard "
            "each block, so one block's parameters are whole at a time")


# ---------------------------------------------------------------------- parallelize: activations
@pytest.mark.exercise("parallelize")
def test_norms_see_their_sequence_shard(results):
    """With tp 2, every RMSNorm's input is (b, t / 2, dim): sequence parallelism."""
    for name in ("dp2 x tp2", "pp2 x tp2"):
        for rep in case(results, name):
            assert rep["norm_inputs"], f"rank {rep['rank']} ({name}): no RMSNorm was called"
            for norm, shape in rep["norm_inputs"].items():
                assert shape[1] * 2 == rep["seq"], (
                    f"rank {rep['rank']} ({name}): {norm} saw an input of shape {shape}, the whole "
                    f"sequence of {rep['seq']} positions. {SP}")


@pytest.mark.exercise("parallelize")
def test_logits_split_over_the_vocabulary(results):
    """With loss_parallel, the output layer is column-parallel and the logits a DTensor Shard(2) on tp."""
    for rep in case(results, "dp2 x tp2", trained=False):
        out = rep["params"]["output.weight"]
        assert "tp" in out["dims"] and any("Shard(dim=0)" in p for p, d in zip(out["placements"], out["dims"]) if d == "tp"), (
            f"rank {rep['rank']}: output.weight has placements {out['placements']} on {out['dims']}: "
            "the output layer must be column-parallel on mesh['tp'] (each rank a slice of the "
            "vocabulary), which is what loss_parallel() expects; left out of the plan, every tp rank "
            "holds the whole output layer and computes every logit")
    for rep in case(results, "dp2 x tp2"):
        logits = rep["logits"]
        assert logits["dtensor"] and logits["placements"] == ["Shard(dim=2)"], (
            f"rank {rep['rank']}: the logits are {'a DTensor ' + str(logits['placements']) if logits['dtensor'] else 'a plain tensor'} "
            f"of local shape {logits['local_shape']}: with loss_parallel=True they stay split over the "
            "vocabulary, a DTensor with placement Shard(2) on the tp mesh (ColwiseParallel("
            "output_layouts=Shard(-1), use_local_output=False)), so no rank gathers the whole "
            "(b, t, vocab) tensor and loss_parallel() computes the cross-entropy on the shards")


@pytest.mark.exercise("parallelize")
def test_whole_logits_without_loss_parallel(results):
    """With loss_parallel=False the logits are a plain (b, t, vocab) tensor, the same on the tp ranks."""
    for rep in case(results, "dp2 x tp2, whole logits"):
        logits = rep["logits"]
        assert not logits["dtensor"] and logits["local_shape"][-1] == 256, (
            f"rank {rep['rank']}: with loss_parallel=False the logits are "
            f"{'a DTensor ' + str(logits['placements']) if logits['dtensor'] else 'a plain tensor'} of local "
            f"shape {logits['local_shape']}: the caller computes a plain cross-entropy, so gather "
            "them over the vocabulary (output_layouts=Replicate(), a plain tensor)")
        assert rep["losses"][0] == pytest.approx(rep["reference_losses"][0], rel=LOSS_RTOL)


@pytest.mark.exercise("parallelize")
def test_checkpointing_keeps_only_block_inputs(results):
    """activation_checkpointing=True: the forward keeps far less for the backward than without it."""
    for rep, plain in kept_next_to(results, "dp2 x tp2, checkpointing", "dp2 x tp2"):
        assert rep["saved_bytes"] < 0.5 * plain, (
            f"rank {rep['rank']}: with activation_checkpointing=True the forward kept "
            f"{rep['saved_bytes']} bytes for the backward, without it {plain}: wrap each "
            "block (checkpoint_wrapper) so that it keeps only its input and recomputes the rest "
            "during the backward")
        assert rep["param_diff"] < PARAM_ATOL, (
            f"rank {rep['rank']}: with checkpointing the parameters differ from one process's by "
            f"{rep['param_diff']:.2e}: recomputation must give the same gradients")


@pytest.mark.exercise("parallelize")
def test_mixed_precision_policy_applies(results):
    """mp_policy with bf16 parameters: the layers compute in bf16; training follows one process at bf16 precision."""
    for rep in case(results, "dp2 x tp2, bf16"):
        wrong = not_in_bf16(rep)
        assert not wrong, (
            f"rank {rep['rank']}: with mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
            f"these layers computed with weights of dtypes {wrong}: pass mp_policy to every "
            "fully_shard call (the blocks' and the root's)")
        for got, want in zip(rep["losses"], rep["reference_losses"]):
            assert got == pytest.approx(want, rel=BF16_LOSS_RTOL), (
                f"rank {rep['rank']}: bf16 losses {rep['losses']} vs one process (fp32) "
                f"{rep['reference_losses']}")


# ------------------------------------------------------------------------ parallelize: training
@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", ["dp2 x tp2", "pp2 x tp2"])
def test_trains_like_one_process(results, name):
    """Losses and parameters after AdamW steps equal one process's on the whole model and batches."""
    for rep in case(results, name):
        for step, (got, want) in enumerate(zip(rep["losses"], rep["reference_losses"])):
            assert got == pytest.approx(want, rel=LOSS_RTOL), (
                f"rank {rep['rank']} ({name}): loss of step {step} is {got:.6f}, one process has "
                f"{want:.6f}." + (" The first step already differs: the forward is wrong." if step == 0 else
                                  " The first step agrees, so the gradients are wrong: not averaged over "
                                  "the dp replicas (FSDP on mesh['dp'] does it), or a norm left out of "
                                  "the tensor-parallel plan on sequence-split activations, whose weight's "
                                  "gradient then sums over this rank's tokens only."))
        assert rep["param_diff"] < PARAM_ATOL, (
            f"rank {rep['rank']} ({name}): parameters differ from one process's by "
            f"{rep['param_diff']:.2e} after {len(rep['losses'])} steps (tolerance {PARAM_ATOL:g})")


@pytest.mark.exercise("parallelize")
def test_gradients_reduced_over_dp_and_activations_over_tp(results):
    """One step's collectives: FSDP's all-gathers and reduce-scatters on dp, the activations' on tp, none across the world."""
    for rep in case(results, "dp2 x tp2"):
        traffic = rep["traffic"]
        stray = {d: t["calls"] for d, t in traffic.items() if d not in ("dp", "tp")}
        assert not stray, (
            f"rank {rep['rank']}: collectives on groups other than mesh['dp'] and mesh['tp'] in one "
            f"step: {stray}: FSDP over every rank gathers each parameter from all 4 ranks; give "
            "fully_shard mesh=mesh['dp']")
        dp = traffic.get("dp", {}).get("calls", {})
        tp = traffic.get("tp", {}).get("calls", {})
        assert dp.get("all_gather", 0) >= 3 and dp.get("reduce_scatter", 0) >= 3, (
            f"rank {rep['rank']}: on the dp group one step made {dp}: FSDP gathers each unit's "
            "parameters and reduce-scatters its gradients (2 blocks and the root: 3 units)")
        assert tp.get("all_gather", 0) > 0 and tp.get("reduce_scatter", 0) > 0, (
            f"rank {rep['rank']}: on the tp group one step made {tp}: sequence parallelism gathers "
            "the sequence before attention and the MLP and reduce-scatters after them")


# ------------------------------------------------------------------------------ clip_grad_norm_
@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.parametrize("name", ["dp2 x tp2, clipped", "dp2 x tp2, below max_norm"])
def test_norm_over_every_shard(results, name):
    """The returned norm is the whole gradient's 2-norm on every rank, a plain 0-d tensor."""
    for rep in clip(results, name):
        r = rep["returned"]
        assert not r["dtensor"] and r["shape"] == [] and r["dtype"] == "torch.float32", (
            f"rank {rep['rank']} ({name}): returned a {'DTensor' if r['dtensor'] else r['type']} of shape "
            f"{r['shape']} and dtype {r['dtype']}: return a plain 0-d float32 tensor (a DTensor's "
            "norm is itself a DTensor: take its full_tensor())")
        assert rep["total"] == pytest.approx(rep["norm"], rel=NORM_RTOL), (
            f"rank {rep['rank']} ({name}): returned {rep['total']:.6f}, the whole gradient's norm is "
            f"{rep['norm']:.6f}. Every rank holds shards: the norm of its local pieces (to_local()) "
            "is not the model's, and ranks clipping by different norms end with different "
            "models. The squares of all shards add up (a DTensor's norm does that over its mesh); "
            "a replicated piece counts once, and so does a plain-tensor gradient (every rank holds "
            "the whole of it).")


@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.parametrize("name", list(CLIP_CASES))
def test_gradients_scaled_as_one_process(results, name):
    """Every gradient ends as torch.nn.utils.clip_grad_norm_ leaves it for the whole model."""
    for rep in clip(results, name):
        for param, error in rep["grad_errors"].items():
            assert error <= 1e-5 * rep["scale"], (
                f"rank {rep['rank']} ({name}): gradient of {param} off by {error:.2e} after clipping: "
                f"it should be multiplied by min(1, max_norm / norm) = {rep['coef']:.4f} (max_norm "
                f"{rep['max_norm']:.4f}, norm {rep['norm']:.4f})"
                + (" and left alone below max_norm" if rep["coef"] == 1.0 else ""))


@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.parametrize("name", ["pp2 x tp2, clipped", "pp2 x dp2, clipped", "pp2 x tp2, a stage without gradients"])
def test_norm_over_every_pipeline_stage(results, name):
    """With a pipeline, the norm covers every stage's gradients: the same on both stages."""
    for rep in clip(results, name):
        assert rep["total"] == pytest.approx(rep["norm"], rel=NORM_RTOL), (
            f"rank {rep['rank']} (stage {rep['pp_rank']}, {name}): returned {rep['total']:.6f}, the whole "
            f"model's gradient norm is {rep['norm']:.6f}. Each stage holds only its own parameters: "
            "combine the stages over pp_group, and add their squared norms (norms themselves do "
            "not add: sqrt(a^2 + b^2), not a + b); a stage without gradients still joins with 0")


# ---------------------------------------------------------------------------------------- worker
def guarded(fn, shape, *args, **kwargs) -> dict:
    """fn(shape, ...), or a report of what it raised: one broken case does not end the launch."""
    import torch.distributed as dist

    try:
        return fn(shape, *args, **kwargs)
    except Exception as err:
        return {"rank": dist.get_rank(), "shape": list(shape), "pp_rank": 0,
                "error": _error("the case (outside the exercise's own calls)", err)}


def run_all(ctx, cases: dict, clip_cases: dict) -> None:
    """The clipping cases first (they do not use parallelize, so a parallelize that leaves a
    process group broken cannot fail them), then the parallelize cases; each exercise's cases
    only when it is written."""
    _agree(True)     # every rank makes the agreement group first
    if not stub_message(clip_grad_norm_):
        ctx.report(clip={name: guarded(clip_case, shape, factor, no_grad, seed=seed)
                         for name, (shape, factor, no_grad, seed) in clip_cases.items()})
    if not stub_message(parallelize):
        ctx.report(cases={name: guarded(run_case, shape, **options) for name, (shape, options) in cases.items()})


def run_worker(cases: dict, clip_cases: dict) -> None:
    """This file's (or the hidden tests') worker: every case, each rank's report. If every case
    has reported and only the final barrier fails (an exercise that used the default group, e.g.
    FSDP over every rank, broke it with a timeout), the rank still ends cleanly, so the tests read
    the reports instead of all failing with the launch."""
    from helpers.dist import distributed

    done = False
    try:
        with distributed() as ctx:
            run_all(ctx, cases, clip_cases)
            done = True
    except RuntimeError:
        if not done:
            raise


def worker() -> None:
    run_worker(CASES, {name: (*c, 0) for name, c in CLIP_CASES.items()})


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
