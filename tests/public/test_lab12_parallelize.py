"""Public tests of lab 12's exercises, `parallelize` and `clip_grad_norm_`
(labs/lab12_parallelize.py).

Run:  ./run.sh check 12      (or: .venv/bin/python -m pytest tests/public/test_lab12_parallelize.py)

One launch on 4 ranks (gloo on the CPU, or nccl with 4 GPUs) runs every case; this file is also
its worker. Each `parallelize` case builds a small ByteLM on the meta device (a pipeline stage of
it where the mesh has pp > 1), calls parallelize on a (pp, dp, tp) mesh of the 4 ranks,
materialises it (`to_empty`, `init_weights`) and records what each rank holds (every parameter's
mesh, placements and local size, the FSDP units), what the norms and linear layers see in the
first forward (input shapes, dtypes), the logits, what the forward keeps for the backward, the
collectives of a step and of its forward by mesh dimension (helpers.traffic.TrafficMeter; the tp
group's are held to what sequence parallelism needs) and the FSDP units whole at once during the
step (labs/lab12_memory.py's UnitWatch, with their gathered bytes); then it trains a few AdamW
steps (no clipping) and compares losses and parameters with one process that trained the whole
model on the whole batches. Each `clip_grad_norm_` case gives every rank DTensor gradients of
known full values (sharded over a (dp, tp) mesh, some stages of a pipeline each holding their own
parameters) and compares the returned norm and the clipped gradients with the whole model's; a
wrong norm, or the norm a wrong coefficient came from, is named by the misreading it equals
(`wrong_norms`: a rank's own shards, norms added instead of squares, one stage alone...).
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
                 "rank": dist.get_rank(), "seq": cfg.seq, "layers": cfg.layers, "loss_parallel": loss_parallel,
                 "checkpointing": activation_checkpointing, "microbatches": microbatches if pp > 1 else 1,
                 "dp_tp_ranks": sorted(int(r) for r in mesh["dp", "tp"].mesh.flatten().tolist()),
                 "tp_ranks": sorted(int(r) for r in mesh["tp"].mesh.flatten().tolist()),
                 "dp_ranks": sorted(int(r) for r in mesh["dp"].mesh.flatten().tolist())}
    model = pipeline_stage(build_model(cfg), pp_rank, pp)
    rep["parts"] = {part: getattr(model, part) is not None for part in ("tok_embeddings", "output")}
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
    # each block as it sits in model.layers: an FSDP unit itself, or a wrapper around one
    rep["block_is_unit"] = {k: isinstance(b, FSDPModule) for k, b in model.layers.items()}

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
        forward = TrafficMeter(mesh) if step == 1 else contextlib.nullcontext()
        watch = WholeUnits(model) if step == 1 else contextlib.nullcontext()
        with traffic, watch, context():
            if schedule is None:
                saved = SavedTensorBytes(skip_parameters=True) if step == 0 else contextlib.nullcontext()
                with saved, forward:
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
            out["whole_units"] = watch.report()
            if schedule is None:
                out["forward_traffic"] = forward.summary()
        value = value if value is not None else torch.zeros((), device=device)
        if dp > 1 and (schedule is None or pp_rank == pp - 1):
            dist.all_reduce(value, group=mesh["dp"].get_group())
            value /= dp
        if pp > 1:
            dist.all_reduce(value, group=mesh["pp"].get_group())
        out["losses"].append(value.item())
    return out


def WholeUnits(model):
    """While active: the most FSDP units of `model` whole (gathered) at once during a step, and the
    most bytes of gathered parameters they held (labs/lab12_memory.py's UnitWatch, which samples
    before each unit's forward and backward, with each unit's gathered bytes)."""
    from labs.lab12_memory import UnitWatch, gathered_bytes

    class Watch(UnitWatch):
        def __init__(self, model):
            super().__init__(model)
            self.sizes = {id(u): gathered_bytes(u) for u in self.units}     # the root first
            self.most_bytes = 0

        def _sample(self, *_):
            whole = [u for u in self.units if any(g.is_unsharded for g in u._get_fsdp_state()._fsdp_param_groups)]
            self.most_whole = max(self.most_whole, len(whole))
            self.most_bytes = max(self.most_bytes, sum(self.sizes[id(u)] for u in whole))

        def report(self) -> dict:
            sizes = [self.sizes[id(u)] for u in self.units]
            return {"most_whole": self.most_whole, "most_bytes": self.most_bytes, "units": len(self.units),
                    "root_bytes": sizes[0] if sizes else 0, "largest_block_bytes": max(sizes[1:], default=0)}

    return Watch(model)


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
    local_squares = sum(_local(p.grad).double().pow(2).sum().item() for p in mine.values() if p.grad is not None)
    rep["wrong_norms"] = wrong_norms(full, params, have_grads, shape, pp_rank, local_squares)
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
    rep["without_grads"] = sorted(n for n in mine if n not in have_grads)
    # the factor each gradient was multiplied by (least squares against its full value before clipping)
    rep["applied"] = {n: (_full(p.grad).double() * full[n].double()).sum().item() / full[n].double().pow(2).sum().item()
                      for n, p in mine.items() if n in have_grads and p.grad is not None}
    rep["scale"] = max(full[n].abs().max().item() for n in have_grads)
    return rep


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def wrong_norms(full: dict, params: dict, have_grads: set, shape, pp_rank: int, local_squares: float) -> dict[str, float]:
    """The totals that the misreadings of the global norm give on this rank, by what each is (the
    keys of NORM_MISTAKES): from the gradients' full values, their placements and this rank's shards."""
    pp, dp, tp = shape
    sizes = {"dp": dp, "tp": tp}
    stages = sorted({st % pp for _, _, st in params.values()})
    sq = {n: full[n].double().pow(2).sum().item() for n in have_grads}
    dtensors = {st: sum(v for n, v in sq.items() if params[n][2] % pp == st and params[n][1] is not None) for st in stages}
    plain = {st: sum(v for n, v in sq.items() if params[n][2] % pp == st and params[n][1] is None) for st in stages}
    stage = {st: dtensors[st] + plain[st] for st in stages}
    copies = {n: (dp * tp if params[n][1] is None else
                  math.prod(sizes[d] for d, pl in zip(("dp", "tp"), params[n][1]) if pl == "Replicate()")) for n in sq}
    out = {"local shards": math.sqrt(local_squares),
           "parameters' norms added": sum(math.sqrt(v) for v in sq.values()),
           "squared": sum(stage.values()),
           "replicas counted": math.sqrt(sum(copies[n] * v for n, v in sq.items())),
           "plain left out": math.sqrt(sum(dtensors.values())),
           "groups' norms added": math.sqrt(sum((math.sqrt(dtensors[st]) + math.sqrt(plain[st])) ** 2 for st in stages))}
    if pp > 1:
        out.update({"this stage": math.sqrt(stage.get(pp_rank, 0.0)),
                    "stages' norms added": sum(math.sqrt(v) for v in stage.values()),
                    "stages over every rank": math.sqrt(dp * tp * sum(stage.values()))})
    return out


NORM_MISTAKES = {   # what a total that equals one of wrong_norms' means
    "local shards": "the norm of this rank's own pieces (to_local()): every rank holds shards, and the norm of "
                    "its pieces is neither the model's nor the same on every rank; a DTensor's norm "
                    "(get_total_norm on the DTensor gradients) sums the shards' squares over its mesh",
    "parameters' norms added": "the parameters' norms added: norms do not add, their squares do "
                               "(sqrt(a^2 + b^2), not a + b)",
    "groups' norms added": "the DTensor gradients' norm and the plain tensors' norm added: norms do not add, "
                           "their squares do (sqrt(a^2 + b^2), not a + b)",
    "stages' norms added": "the stages' norms added over pp_group: norms do not add, their squares do: "
                           "sum the stages' squared norms, then take the root",
    "squared": "the sum of the squares without its square root",
    "replicas counted": "every rank's squares summed over all ranks: a piece replicated on several ranks (a "
                        "Replicate placement, a plain tensor) is then counted once per copy; a DTensor's norm "
                        "counts it once, and only the stages (pp_group) remain to be summed",
    "plain left out": "the norm of the DTensor gradients alone: the plain-tensor gradients count too (every "
                      "rank of the stage holds the whole of each, so each counts once)",
    "this stage": "this stage's norm alone: the other stages' gradients are on the other ranks of pp_group; "
                  "sum the stages' squared norms over it",
    "stages over every rank": "the stages' squared norms summed over every rank instead of over pp_group: each "
                              "stage's is counted once per rank of its dp x tp grid",
}


def norm_mistake(rep: dict, value: float) -> str:
    """' That is <what>.' when `value` equals one of the misreadings of this rank's case, else ''."""
    for key, wrong in rep.get("wrong_norms", {}).items():
        if wrong != pytest.approx(rep["norm"], rel=1e-4) and value == pytest.approx(wrong, rel=1e-4):
            return f" That is {NORM_MISTAKES[key]}."
    return ""


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
            layout = f" {unsplit_matrices(rep)}" if key == "train_error" and unsplit_matrices(rep) else ""
            pytest.fail(f"rank {rep['rank']} ({name}, mesh pp x dp x tp = {' x '.join(map(str, rep['shape']))}): "
                        f"{rep[key]}.{layout}{hints(name, rep[key])}")
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
      "(output_layouts=Shard(1)), and each attention and MLP gathering the whole sequence once, at "
      "its input, for all of its column-parallel layers.")


def matrices(rep: dict) -> dict[str, dict]:
    return {n: e for n, e in rep["params"].items() if not n.endswith("norm.weight")}


def kept_next_to(results, name: str, plain: str) -> list[tuple[dict, int]]:
    """(report, bytes the same rank kept for the backward in case `plain`) for each rank of case `name`."""
    kept = {rep["rank"]: rep["saved_bytes"] for rep in case(results, plain)}
    return [(rep, kept[rep["rank"]]) for rep in case(results, name)]


def not_in_bf16(rep: dict) -> dict[str, list]:
    """The linear layers that computed with weights of another dtype than bfloat16."""
    return {n: d for n, d in rep["linear_dtypes"].items() if d[1] != "bfloat16"}


def tp_placement(entry: dict) -> str | None:
    """A parameter's placement on the tp dimension (None: not split or replicated over tp)."""
    return dict(zip(entry["dims"], entry["placements"])).get("tp")


def unsplit_matrices(rep: dict) -> str:
    """The matrices left out of the tensor-parallel plan (not on the tp dimension), named; "" if none."""
    if rep["shape"][2] == 1 or "params" not in rep:
        return ""
    left = [n for n, e in matrices(rep).items() if tp_placement(e) is None]
    return (f"Not split over tp: {', '.join(left)}: left out of the tensor-parallel plan, such a layer holds its "
            "whole weight while its input is this rank's part (a row-parallel wo or w2 gets this rank's heads "
            "or MLP columns; the output layer gets a DTensor)." if left else "")


def vocabulary_problem(rep: dict, name: str) -> str | None:
    """What is wrong with how the embedding and the output layer are split over tp, or None: both
    must be split over the vocabulary (the rows of either weight: Shard(0) on tp)."""
    if rep["shape"][2] == 1:
        return None
    for param, layer in (("tok_embeddings.weight", "embedding"), ("output.weight", "output layer")):
        if param not in rep["params"]:
            continue
        entry = rep["params"][param]
        placement = tp_placement(entry)
        if placement == "Shard(dim=0)":
            continue
        who = f"rank {rep['rank']} ({name}): "
        held = f" ({param}: placements {entry['placements']} on {entry['dims']})"
        if placement is None:
            return (f"{who}the {layer} is left out of the tensor-parallel plan{held}: every tp rank holds all "
                    "of it and " + ("looks up whole vectors; split over the vocabulary (its rows), each tp rank "
                                    "holds the rows of some tokens" if layer == "embedding" else
                                    "computes every logit; loss_parallel() needs each tp rank to hold a slice of "
                                    "the vocabulary (the weight's rows: column-parallel) and compute those logits"))
        if layer == "embedding":
            return (f"{who}the embedding is split by its columns (each tp rank a slice of every token's vector), "
                    f"not over the vocabulary{held}. The contract asks for a vocabulary-parallel embedding: each tp "
                    "rank holds the rows of some tokens, looks up those it holds (zeros for the others) and one "
                    "reduce-scatter sums the ranks' lookups into sequence shards; split by columns, the vectors' "
                    "slices are gathered instead, and the step's traffic changes")
        return (f"{who}the output layer is row-parallel (split over its input width: every rank computes partial "
                f"logits for the whole vocabulary, to be summed){held}; loss_parallel() needs it column-parallel: "
                "each tp rank holds a slice of the vocabulary (the weight's rows) and computes those logits from "
                "the gathered sequence")
    return None


def tp_expected(rep: dict) -> tuple[dict, dict]:
    """(one forward's, one step's) all-gathers and reduce-scatters on tp that sequence parallelism
    needs on this rank's stage. Per micro-batch's forward: an all-gather of the sequence into each
    attention, each MLP and the output layer (with whole logits, one more of the vocabulary after
    it), a reduce-scatter out of each attention, each MLP and the embedding; the backward carries
    the gradient of each sequence gather as a reduce-scatter and of each reduce-scatter as an
    all-gather (the vocabulary gather's gradient is a local slice)."""
    blocks, parts, microbatches = len(rep["blocks"]), rep["parts"], rep["microbatches"]
    into = 2 * blocks + parts["output"]
    vocab = int(parts["output"] and not rep["loss_parallel"])
    out_of = 2 * blocks + parts["tok_embeddings"]
    return ({"all_gather": into + vocab, "reduce_scatter": out_of},
            {"all_gather": microbatches * (into + vocab + out_of), "reduce_scatter": microbatches * (out_of + into)})


def tp_traffic_problem(rep: dict, name: str) -> str | None:
    """The tp group's all-gathers and reduce-scatters measured (helpers.traffic.TrafficMeter) in
    one forward (without a pipeline) and one step (without checkpointing, whose recomputation
    gathers again) against `tp_expected`; what is wrong, or None."""
    if rep["shape"][2] == 1:
        return None
    forward, step = tp_expected(rep)
    blocks = len(rep["blocks"])
    checks = [] if rep["checkpointing"] else [("one training step", rep["traffic"], step)]
    if rep["microbatches"] == 1:
        checks.insert(0, ("one forward", rep["forward_traffic"], forward))
    for what, traffic, want in checks:
        calls = traffic.get("tp", {}).get("calls", {})
        got = {kind: calls.get(kind, 0) for kind in want}
        if got == want:
            continue
        ag, rs = got["all_gather"] - want["all_gather"], got["reduce_scatter"] - want["reduce_scatter"]
        if not got["all_gather"] and not got["reduce_scatter"]:
            why = ("None at all: the activations are not split along the sequence between the layers "
                   f"(tensor parallelism without sequence parallelism: {calls.get('all_reduce', 0)} all-reduces instead)")
        elif ag > 0 and rs == 0 and what == "one forward":
            why = (f"{ag} all-gathers too many: a layer gathers the sequence for itself. Gathered once at the "
                   "entry of attention and of the MLP, the whole sequence serves all their column-parallel "
                   "layers, which otherwise each gather it again (wq, wk, wv, w1)")
        elif ag == 1 and rs == -1 and rep["parts"]["tok_embeddings"] and what == "one forward":
            why = ("The embedding's output is gathered instead of reduce-scattered: an embedding split by its "
                   "columns gathers the slices of each vector; split over the vocabulary, a reduce-scatter sums "
                   "the ranks' lookups straight into sequence shards")
        else:
            why = ("Each collective more or fewer is a layout that two neighbouring layers disagree on: DTensor "
                   "redistributes between them by itself, silently")
        return (f"rank {rep['rank']} ({name}): {what} made {got['all_gather']} all-gathers and {got['reduce_scatter']} "
                f"reduce-scatters on the tp group, where sequence parallelism needs {want['all_gather']} and "
                f"{want['reduce_scatter']}. {why}. (This stage: {blocks} block{'s' if blocks != 1 else ''}"
                + (", the embedding" if rep["parts"]["tok_embeddings"] else "") + (", the output layer" if rep["parts"]["output"] else "")
                + (f", {rep['microbatches']} micro-batches" if rep["microbatches"] > 1 else "")
                + "; per forward one all-gather of the sequence into each attention, each MLP and the output layer, "
                "one reduce-scatter out of each attention, each MLP and the embedding, and the backward the "
                "reverse.)")
    return None


def whole_units_problem(rep: dict, name: str) -> str | None:
    """Without a pipeline and with dp > 1: were more FSDP units whole at once during a step than the
    root and one block (what resharding each block after its forward allows)? What is wrong, or
    None. (A pipeline keeps every unit of its stage whole until the step's end anyway:
    labs/lab12_memory.py.)"""
    pp, dp, _ = rep["shape"]
    if pp > 1 or dp == 1:
        return None
    w = rep["whole_units"]
    limit = w["root_bytes"] + w["largest_block_bytes"]
    if w["most_whole"] <= 2 and w["most_bytes"] <= limit:
        return None
    gathers = rep["traffic"].get("dp", {}).get("calls", {}).get("all_gather", 0)
    return (f"rank {rep['rank']} ({name}): during one step {w['most_whole']} of the {w['units']} FSDP units were "
            f"whole at once ({w['most_bytes']:,} bytes of gathered parameters), where FSDP needs at most the root "
            f"and one block ({w['root_bytes']:,} + {w['largest_block_bytes']:,} = {limit:,} bytes): blocks kept "
            "gathered after their forward (reshard_after_forward=False) stay whole until their backward, so at "
            "the backward's start every block is whole on every dp rank and FSDP's saving on parameters is "
            f"gone ({gathers} all-gathers on dp in the step). torchtitan keeps blocks whole only under a "
            "pipeline, which keeps a stage's units whole anyway")


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
                + (("Half: it is not split over tp, left out of the tensor-parallel plan." if tp_placement(e) is None
                    else "Half: it is not split over dp (FSDP, mesh['dp'], per block and at the root).")
                   if e["local"] * 2 == e["global"]
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
def test_embedding_split_over_the_vocabulary(results):
    """The embedding is vocabulary-parallel: each tp rank holds the rows of some tokens (Shard(0) on tp)."""
    for rep in case(results, "dp2 x tp2", trained=False):
        problem = vocabulary_problem(rep, "dp2 x tp2")
        assert not problem, problem


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", ["dp2 x tp2", "dp2 x tp2, checkpointing"])
def test_fsdp_unit_per_block_and_root(results, name):
    """fully_shard is applied to every block as model.layers holds it (checkpointed or not) and to the model itself."""
    for rep in case(results, name, trained=False):
        problem = fsdp_units_problem(rep, name)
        assert not problem, problem


def fsdp_units_problem(rep: dict, name: str) -> str | None:
    """The root and every block of model.layers, as it holds them, must be FSDP units: what is not, or None."""
    units = set(rep["fsdp_units"])
    missing = [f"layers.{k}" for k in rep["blocks"] if f"layers.{k}" not in units]
    if "" not in units:
        return (f"rank {rep['rank']} ({name}): the model itself is not an FSDP module: "
                "fully_shard(model, mesh=mesh['dp']) last, after the blocks")
    if missing:
        return (f"rank {rep['rank']} ({name}): blocks {missing} are not FSDP units (units: {sorted(units)}): with "
                "one unit at the root, the whole model's parameters are gathered at once; fully_shard "
                "each block, so one block's parameters are whole at a time")
    wrapped = sorted(k for k, is_unit in rep["block_is_unit"].items() if not is_unit)
    if wrapped:
        return (f"rank {rep['rank']} ({name}): model.layers holds blocks {wrapped} that are not FSDP units: "
                "their unit sits inside a checkpoint wrapper, so checkpoint_wrapper was applied after "
                "fully_shard. The contract wants each block, as model.layers holds it, to be its unit, "
                "the checkpointed block inside it (torchtitan's order: checkpointing, then FSDP): FSDP's "
                "gathering then wraps the block's whole forward, recomputation included, and FSDP's "
                "per-unit controls (unshard(), set_modules_to_forward_prefetch, which torchtitan calls on "
                "model.layers' blocks) are on the block the model holds")
    return None


@pytest.mark.exercise("parallelize")
def test_blocks_resharded_after_forward(results):
    """During a step at most the root and one block are whole at once (measured): FSDP's saving on parameters holds."""
    for name in ("dp2 x tp2", "dp2 x tp2, checkpointing"):
        for rep in case(results, name):
            problem = whole_units_problem(rep, name)
            assert not problem, problem


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
        problem = vocabulary_problem(rep, "dp2 x tp2")
        assert not problem, problem
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


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", [n for n, (shape, _) in CASES.items() if shape[2] > 1])
def test_sequence_parallel_traffic(results, name):
    """The tp group's all-gathers and reduce-scatters in a forward and a step, counted, are what sequence parallelism needs."""
    for rep in case(results, name):
        problem = tp_traffic_problem(rep, name)
        assert not problem, problem


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
            f"{rep['norm']:.6f}." + (norm_mistake(rep, rep["total"]) or
            " The squares of all shards add up (a DTensor's norm does that over its mesh); a "
            "replicated piece counts once, and so does a plain-tensor gradient (every rank holds "
            "the whole of it); ranks clipping by different norms end with different models."))


@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.parametrize("name", ["pp2 x tp2, clipped", "pp2 x dp2, clipped", "pp2 x tp2, a stage without gradients"])
def test_norm_over_every_pipeline_stage(results, name):
    """With a pipeline, the norm covers every stage's gradients: the same on both stages."""
    for rep in clip(results, name):
        assert rep["total"] == pytest.approx(rep["norm"], rel=NORM_RTOL), (
            f"rank {rep['rank']} (stage {rep['pp_rank']}, {name}): returned {rep['total']:.6f}, the whole "
            f"model's gradient norm is {rep['norm']:.6f}." + (norm_mistake(rep, rep["total"]) or
            " Each stage holds only its own parameters: combine the stages over pp_group, and add "
            "their squared norms (norms themselves do not add: sqrt(a^2 + b^2), not a + b); a stage "
            "without gradients still joins with 0"))


@pytest.mark.exercise("clip_grad_norm_")
@pytest.mark.parametrize("name", list(CLIP_CASES))
def test_gradients_scaled_as_one_process(results, name):
    """Every gradient ends as torch.nn.utils.clip_grad_norm_ leaves it for the whole model."""
    for rep in clip(results, name):
        for param, error in rep["grad_errors"].items():
            assert error <= 1e-5 * rep["scale"], scaling_problem(rep, name, param, error)


def scaling_problem(rep: dict, name: str, param: str, error: float) -> str:
    """What a gradient scaled wrongly by clip_grad_norm_ was multiplied by, and what that means."""
    applied = rep["applied"].get(param)
    if param in rep["without_grads"]:
        return (f"rank {rep['rank']} ({name}): {param} had no gradient and has one after clipping "
                f"(largest entry {error:.2e}): a parameter without a gradient is skipped")
    out = (f"rank {rep['rank']} ({name}): gradient of {param} off by {error:.2e} after clipping: it should be "
           f"multiplied by min(1, max_norm / norm) = {rep['coef']:.4f} (max_norm {rep['max_norm']:.4f}, norm "
           f"{rep['norm']:.4f})" + (" and left alone below max_norm" if rep["coef"] == 1.0 else ""))
    if applied is None:
        return out + ", and it has no gradient left"
    out += f"; it was multiplied by {applied:.4f}"
    if applied > 1 + 1e-4:
        return out + ": a clipping coefficient is at most 1 (min(1, max_norm / norm)): below max_norm nothing changes"
    if applied < 1 - 1e-4:
        used = rep["max_norm"] / applied
        return out + f", max_norm / {used:.4f}." + (norm_mistake(rep, used) or
                                                   " The same coefficient, from the global norm, on every gradient of every rank")
    return out + ": left as it was"


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
