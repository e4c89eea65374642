"""Public tests of lab 13's exercise, `parallelize` (labs/lab13_parallelize.py).

Run:  ./run.sh check 13      (or: .venv/bin/python -m pytest tests/public/test_lab13_parallelize.py)

One launch on 4 ranks (gloo on the CPU, or nccl with 4 GPUs) runs every case; this file is also
its worker. Each case builds the grown-up model (labs/lab13_model.py, a small one) on a 5-D mesh
of the 4 ranks, calls `parallelize`, records what each rank holds and how each attention, MoE
layer, router and FSDP unit was placed, then trains two AdamW steps with labs/lab13_train.py's
training loop (the course's code around the exercise) and compares with one process on the whole
batches: every step's loss, the first step's gradients, the parameters and the routers' biases
after the steps, and one step's collectives by mesh dimension.
"""
from __future__ import annotations

import math
import sys
import traceback

import pytest
import torch

from helpers.notice import Unsolved, stub_message
from labs.lab13_parallelize import parallelize
from tests.harness import launch_ranks

NPROC = 4
LOSS_RTOL, GRAD_ATOL, PARAM_ATOL = 1e-4, 1e-5, 1e-4   # labs/lab13_train.py's (float32)
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
CONFIG = dict(dim=32, heads=4, kv_heads=2, layers=2, ffn=64, seq=32, batch=4, experts=4, expert_ffn=16,
              shared_ffn=16)
# name: (mesh sizes, options)
CASES = {
    "dp_shard 2 x cp 2": ({"dp_shard": 2, "cp": 2}, {}),
    "cp 2 x tp 2": ({"cp": 2, "tp": 2}, {}),
    "dp_replicate 2 x cp 2 (HSDP)": ({"dp_replicate": 2, "cp": 2}, {}),
    "pp 2 x cp 2": ({"pp": 2, "cp": 2}, {}),
}


# ============================================================================ the worker's side
_SEEN: dict = {}


def describe(model, mesh) -> dict:
    """How `parallelize` placed things on this rank, read from the model (before training)."""
    from torch.distributed.fsdp import FSDPModule

    from labs.lab12_model import canonical_name

    out: dict = {"attention": {}, "moe": {}, "params": {}, "units": {}}
    for key, block in model.layers.items():
        a = block.attention
        out["attention"][key] = {
            "positions": None if a.positions is None else [int(p) for p in a.positions],
            "context": type(a.context).__name__ if a.context is not None else None,
            "context_ranks": sorted(getattr(a.context, "ranks", []) or []),
            "design": getattr(a.context, "design", None)}
        if block.moe is not None:
            ex, sh, router = block.moe.experts, block.moe.shared_expert, block.moe.router
            out["moe"][key] = {
                "first": ex.first, "num": ex.num_experts, "ep_ranks": getattr(ex, "ep_ranks", []),
                "dispatched": ex.dispatcher is not None, "shared_dispatched": sh is not None and sh.dispatcher is not None,
                "ffn": list(ex.ffn_slice), "ffn_width": model.config.expert_ffn // mesh["tp"].size(),
                "tp_rank": mesh["tp"].get_local_rank(),
                "load_ranks": (sorted(torch.distributed.get_process_group_ranks(router.load_group))
                               if router.load_group is not None else None)}
    for name, p in model.named_parameters():
        entry = {"dims": [], "placements": [], "ranks": [], "local": p.numel()}
        if hasattr(p, "device_mesh"):
            entry = {"dims": list(p.device_mesh.mesh_dim_names or ()), "placements": [repr(x) for x in p.placements],
                     "ranks": sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist()),
                     "local": p.to_local().numel()}
        out["params"][canonical_name(name)] = entry
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            out["units"][canonical_name(name) or "(root)"] = {}
    return out


def spy(model, mesh, **options):
    """The exercise, then a description of what it did (kept for the report)."""
    returned = parallelize(model, mesh, **options)
    model = returned if returned is not None else model
    _SEEN["model"], _SEEN["description"] = model, describe(model, mesh)
    return model


def reshard_flags(model) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from labs.lab12_model import canonical_name

    flags = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            flags[canonical_name(name) or "(root)"] = [g._reshard_after_forward for g in groups]
    return flags


def run_case(ctx, sizes: dict, options: dict, steps: int = 2) -> dict:
    """One case on this rank: what parallelize placed, and the run against one process.
    `options`: check_run's (design, ...), and "config": changes to CONFIG."""
    import torch.distributed as dist

    from labs.lab13_model import corpus, default_config, split
    from labs.lab13_train import check_run, reference_run

    options = dict(options)
    config = {**CONFIG, **options.pop("config", {})}
    rank = dist.get_rank()
    rep: dict = {"rank": rank, "sizes": {d: sizes.get(d, 1) for d in DIMS}, "config": config}
    _SEEN.clear()
    error = None
    try:
        cfg = default_config(**config)        # the reference here: a broken case may break the default group
        reference = reference_run(cfg, steps, split(corpus())[0], ctx.device)
        out = check_run(ctx, sizes, config=cfg, steps=steps, parallelize_fn=spy, reference=reference, **options)
        rep.update({k: out[k] for k in ("losses", "reference_losses", "grad_diff", "param_diff", "bias_diff",
                                        "traffic", "pp_rank")})
    except Exception as err:
        error = _error(err)
    rep.update(_SEEN.get("description", {}))
    if "model" in _SEEN and error is None:
        rep["reshard"] = reshard_flags(_SEEN["model"])
    _SEEN.clear()
    if not _agree(error is None):
        rep["error"] = error or "the case failed on another rank (its report says why)"
    return rep


_AGREEMENT: dict = {}


def _agree(ok: bool) -> bool:
    """True on every rank if `ok` on every rank (its own gloo group, three timeouts long: a rank
    stuck in a collective of the failed case joins once that collective has timed out)."""
    import datetime

    import torch.distributed as dist

    from helpers.dist import timeout_seconds

    if "group" not in _AGREEMENT:
        _AGREEMENT["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * timeout_seconds()))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_AGREEMENT["group"])
    return bool(flag.item())


def _error(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/labs/" in f.filename]
    where = f" (at labs/{frames[-1].filename.split('/labs/')[-1]}:{frames[-1].lineno})" if frames else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:400]}{where}"


def run_worker(cases: dict) -> None:
    """This file's (or the hidden tests') worker: every case, each rank's report. If every case
    has reported and only the final barrier fails (a case whose ranks parted ways, e.g. a
    pipeline stage left waiting for another, broke the default group with a timeout), the rank
    still ends cleanly, so the tests read the reports instead of all failing with the launch."""
    from helpers.dist import distributed

    done = False
    try:
        with distributed() as ctx:
            _agree(True)
            ctx.report(cases={name: run_case(ctx, sizes, options) for name, (sizes, options) in cases.items()})
            done = True
    except RuntimeError:
        if not done:
            raise


# ============================================================================ the test's side
@pytest.fixture(scope="module")
def results():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=300, env={"DIST_TIMEOUT": "30"}, needs=[parallelize])


def grid(sizes: dict) -> torch.Tensor:
    shape = [sizes.get(d, 1) for d in DIMS]
    return torch.arange(math.prod(shape)).reshape(shape)


def group_of(rank: int, sizes: dict, dims: tuple[str, ...]) -> list[int]:
    """The ranks of `rank`'s group along `dims` of the mesh of `sizes` (torchtitan's order)."""
    g = grid(sizes)
    where = [int(i) for i in (g == rank).nonzero()[0]]
    index = tuple(slice(None) if d in dims else where[i] for i, d in enumerate(DIMS))
    return sorted(int(r) for r in g[index].flatten())


def case(results, name: str) -> list[dict]:
    """Every rank's report of one case; a case that failed fails here, with the likely cause."""
    message = stub_message(parallelize)
    if message:
        raise Unsolved(message)
    reps = [results[rank]["cases"][name] for rank in range(NPROC)]
    failed = [r for r in reps if "error" in r]
    if failed:
        rep = next((r for r in failed if "another rank" not in r["error"] and "Timed out" not in r["error"]), failed[0])
        pytest.fail(f"rank {rep['rank']} ({name}): {rep['error']}.{hints(rep['error'])}")
    return reps


def hints(error: str) -> str:
    out = ""
    if "(at labs/lab13_parallelize.py" in error and "not divisible" not in error:
        out += (" It was raised in parallelize: the order is tensor parallelism (mesh['tp']), then the attention "
                "and the experts, then FSDP from the leaves up, every fully_shard given its sub-mesh (without "
                "mesh= it shards over every rank, tp and pp ranks included).")
    if "experts over the expert-parallel ranks: 1 is not divisible" in error:
        out += (" The shared expert was given to expert_parallel: it runs on every token, on the rank "
                "where the token is; only moe.experts (the routed ones) go over the ep ranks.")
    if "not divisible" in error and "experts" in error and "1 is not" not in error:
        out += " The experts go over mesh['dp_shard_cp'] (ep = dp_shard x cp)."
    if ("DTensor" in error or "mesh" in error.lower()) and "(at labs/lab13_parallelize.py" not in error:
        out += (" Tensor parallelism first (notebook 12's plan on mesh['tp'], moe_tensor_parallel for an MoE "
                "block), then FSDP on the data-parallel sub-mesh: fully_shard without mesh= shards over every "
                "rank, tp ranks included, which torch refuses for parameters already split over mesh['tp'].")
    return out


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_attention_at_global_positions(results, name):
    """Every attention layer turns and masks its rows at their zig-zag global positions."""
    check_attention_at_global_positions(results, name)


def check_attention_at_global_positions(results, name):
    from labs.lab13_context import cp_positions

    seen = []                                      # (rank, layer, positions used, positions held)
    for rep in case(results, name):
        sizes, seq = rep["sizes"], rep["config"]["seq"]
        cp_rank = group_of(rep["rank"], sizes, ("cp",)).index(rep["rank"])
        expected = cp_positions(seq, sizes["cp"], cp_rank).tolist()
        for key, a in rep["attention"].items():
            got = a["positions"] if a["positions"] is not None else list(range(seq // sizes["cp"]))
            seen.append((rep["rank"], key, got, expected))
    wrong = [s for s in seen if s[2] != s[3]]
    if not wrong:
        return
    why = ""
    if all(got == list(range(len(got))) for _, _, got, _ in seen):
        why = (" Positions counted from 0 on every shard are the shard's, not the sequence's: every cp rank "
               "turns its rows as if they began the sequence, and masks as if its keys were the only ones.")
    elif all(got == list(range(got[0], got[0] + len(got))) for _, _, got, _ in seen):
        why = (" These are contiguous positions; the training loop cuts each sequence in the zig-zag layout "
               "(chunks r and 2 cp - 1 - r: the causal mask's work balanced over the ranks): cp_positions.")
    rank, key, got, expected = wrong[0]
    pytest.fail(f"rank {rank} ({name}), layer {key}: the attention computes rotary angles and the causal mask at "
                f"positions {got[:4]}...{got[-2:]}, but this rank holds the columns {expected[:4]}...{expected[-2:]} "
                f"of each sequence (cp_positions(seq, cp, cp rank)).{why}")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_the_cp_group(results, name):
    """With cp > 1, every attention attends over the whole sequence held by its mesh['cp'] group."""
    check_attention_over_the_cp_group(results, name)


def check_attention_over_the_cp_group(results, name):
    for rep in case(results, name):
        if rep["sizes"]["cp"] == 1:
            continue
        cp_group = group_of(rep["rank"], rep["sizes"], ("cp",))
        for key, a in rep["attention"].items():
            assert a["context"] is not None, (
                f"rank {rep['rank']} ({name}), layer {key}: the attention has no context, so each cp rank "
                "attends only over its own shard of the sequence (a causal mask per shard): the keys and values "
                "of the other cp ranks' positions are never seen. context_parallel(attention, mesh['cp'], "
                "positions) makes it attend over the whole sequence.")
            assert a["context_ranks"] == cp_group, (
                f"rank {rep['rank']} ({name}), layer {key}: the attention's ring runs over ranks "
                f"{a['context_ranks']}, this rank's cp group is {cp_group}: the sequence is split over mesh['cp']")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_experts_over_dp_shard_cp(results, name):
    """Each MoE layer's routed experts are split over ep = dp_shard x cp, E/ep per rank, in rank order."""
    check_experts_over_dp_shard_cp(results, name)


def check_experts_over_dp_shard_cp(results, name):
    for rep in case(results, name):
        ep = group_of(rep["rank"], rep["sizes"], ("dp_shard", "cp"))
        local = rep["config"]["experts"] // len(ep)
        for key, m in rep["moe"].items():
            assert m["dispatched"] and m["ep_ranks"] == ep, (
                f"rank {rep['rank']} ({name}), layer {key}: the routed experts are "
                + (f"split over ranks {m['ep_ranks']}" if m["dispatched"] else "not split at all")
                + f"; ep is this rank's dp_shard x cp group {ep} (mesh['dp_shard_cp']): the ranks that hold the "
                "same weights and different tokens. Over fewer ranks, the cp (or dp_shard) partners hold the same "
                "experts and their gradients are never summed; over the tp ranks, each would hold experts already "
                "split by expert tensor parallelism.")
            assert (m["num"], m["first"]) == (local, ep.index(rep["rank"]) * local), (
                f"rank {rep['rank']} ({name}), layer {key}: holds experts {m['first']}..{m['first'] + m['num'] - 1}, "
                f"expected {local} of them from {ep.index(rep['rank']) * local}")
            assert not m["shared_dispatched"], (
                f"rank {rep['rank']} ({name}), layer {key}: the shared expert goes through the all-to-all: it runs on "
                "every token, on the rank where the token is, and is never dispatched")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_load_counted_over_the_batch(results, name):
    """Every router sums its experts' load over the ranks of the whole batch, and its bias moves as one process's."""
    check_load_counted_over_the_batch(results, name)


def check_load_counted_over_the_batch(results, name):
    for rep in case(results, name):
        batch = group_of(rep["rank"], rep["sizes"], ("dp_replicate", "dp_shard", "cp"))
        for key, m in rep["moe"].items():
            assert m["load_ranks"] == batch, (
                f"rank {rep['rank']} ({name}), layer {key}: the router counts its load over "
                f"{m['load_ranks'] or 'this rank alone'}; the global batch's tokens are on ranks {batch} "
                "(mesh['dp_cp']). On fewer, each copy of the router sees another load, moves its bias "
                "another way, and the copies route the same tokens differently from the next step on.")
        assert rep["bias_diff"] <= 1e-9, (
            f"rank {rep['rank']} ({name}): the routers' biases differ from one process's by {rep['bias_diff']:.2e}")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_over_dp_shard_cp(results, name):
    """FSDP shards every weight (the routed experts aside) over dp_shard x cp; with dp_replicate it is HSDP."""
    check_fsdp_over_dp_shard_cp(results, name)


def check_fsdp_over_dp_shard_cp(results, name):
    for rep in case(results, name):
        sizes, rank = rep["sizes"], rep["rank"]
        hsdp = sizes["dp_replicate"] > 1
        data = ("dp_replicate", "dp_shard", "cp") if hsdp else ("dp_shard", "cp")
        must = set(group_of(rank, sizes, data))
        allowed = set(group_of(rank, sizes, data + ("tp",)))
        for pname, e in rep["params"].items():
            if ".moe.experts." in pname:
                continue
            where = f"rank {rank} ({name}): {pname} is "
            unsharded = not e["dims"] or set(e["dims"]) <= {"tp"}
            assert not unsharded, (where + ("a plain tensor" if not e["dims"] else f"on {e['dims']} only")
                                   + ": not sharded by FSDP. Every block and the model itself are FSDP units: the "
                                   "root's fully_shard takes what no block holds (the embedding, the final norm, "
                                   "the output layer)")
            ranks = set(e["ranks"])
            assert ranks <= allowed, (
                where + f"spread over ranks {sorted(ranks)}, beyond its data-parallel (and tp) ranks {sorted(allowed)}: "
                "fully_shard without mesh= shards over every rank; give it the data-parallel sub-mesh")
            assert must <= ranks, (
                where + f"sharded over ranks {sorted(ranks & must)} of the {len(must)} that hold the same weight "
                f"{sorted(must)}: FSDP over dp_shard alone never reduces the cp ranks' gradients (they hold the same "
                "weights and see other tokens of the same sequences), and each cp rank trains another model: "
                "shard over mesh['dp_shard_cp']" + (", within each replica (HSDP)" if hsdp else ""))
            placed = [pl for d, pl in zip(e["dims"], e["placements"]) if d != "tp"]
            if hsdp:
                assert len(placed) == 2 and placed[0] == "Replicate()" and "Shard" in placed[1], (
                    where + f"placed {placed} over the data-parallel ranks: with mesh['dp_replicate'] > 1 this is "
                    "HSDP, fully_shard on the 2-D mesh (dp_replicate, dp_shard_cp): sharded within a replica, "
                    "replicated across (the numbers agree with plain FSDP over every rank; the traffic between "
                    "replicas and what a replica can be restarted from do not, notebook 14)")
            else:
                assert len(placed) == 1 and "Shard" in placed[0], where + f"placed {placed} over the data ranks"


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_experts_a_unit_of_their_own(results, name):
    """The routed experts are an FSDP unit over mesh['dp_replicate'], the ranks holding the same experts."""
    check_experts_a_unit_of_their_own(results, name)


def check_experts_a_unit_of_their_own(results, name):
    for rep in case(results, name):
        replicas = group_of(rep["rank"], rep["sizes"], ("dp_replicate",))
        for pname, e in rep["params"].items():
            if ".moe.experts." not in pname:
                continue
            outside = sorted(set(e["ranks"]) - set(replicas))
            assert e["dims"] and not outside, (
                f"rank {rep['rank']} ({name}): {pname} is "
                + (f"sharded over ranks {e['ranks']} (dimensions {e['dims']})" if e["dims"] else "a plain tensor")
                + f": each ep rank holds other experts, so only its replicas {replicas} hold the same ones. "
                "In the block's FSDP unit they would be gathered and averaged with other ranks' different "
                "experts: make moe.experts its own unit, fully_shard(..., mesh=mesh['dp_replicate']), first.")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_first(results, name):
    """With tp > 1, attention, the MLPs and the experts are split over the tp ranks (before FSDP)."""
    check_tensor_parallel_first(results, name)


def check_tensor_parallel_first(results, name):
    for rep in case(results, name):
        if rep["sizes"]["tp"] == 1:
            continue
        wq = next(e for n, e in rep["params"].items() if n.endswith("attention.wq.weight"))
        assert "tp" in wq["dims"], (
            f"rank {rep['rank']} ({name}): attention.wq is on {wq['dims']}: with mesh['tp'] > 1, notebook 12's "
            "tensor-parallel plan comes first (parallelize_module on mesh['tp']); without it every tp rank holds "
            "and computes the whole layer (the numbers agree, the memory and the time do not)")
        for key, m in rep["moe"].items():
            assert m["ffn"] == [m["ffn_width"] * m["tp_rank"], m["ffn_width"] * (m["tp_rank"] + 1)], (
                f"rank {rep['rank']} ({name}), layer {key}: the experts hold hidden columns {m['ffn']} of each "
                "expert: an MoE block's tensor parallelism is moe_tensor_parallel(block, mesh['tp']), which splits "
                "their width and makes the MoE gather the sequence")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_reshard_after_forward_rule(results, name):
    """reshard_after_forward=None: torchtitan's rule, True without a pipeline, False with one."""
    check_reshard_after_forward_rule(results, name)


def check_reshard_after_forward_rule(results, name):
    for rep in case(results, name):
        want = rep["sizes"]["pp"] == 1
        wrong = {u: f for u, f in rep.get("reshard", {}).items() if any(x != want for x in f)}
        assert not wrong, (
            f"rank {rep['rank']} ({name}): FSDP units {sorted(wrong)} have reshard_after_forward "
            f"{sorted({x for f in wrong.values() for x in f})}: with reshard_after_forward=None use torchtitan's "
            "rule, `not pp_enabled`: under a pipeline every unit stays whole from its first backward on, so "
            "resharding after each micro-batch's forward only adds all-gathers")


@pytest.mark.exercise("parallelize")
@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_one_process(results, name):
    """Losses, the first gradients, and the parameters after two AdamW steps equal one process's."""
    check_trains_like_one_process(results, name)


def check_trains_like_one_process(results, name):
    for rep in case(results, name):
        for step, (got, want) in enumerate(zip(rep["losses"], rep["reference_losses"])):
            assert got == pytest.approx(want, rel=LOSS_RTOL), (
                f"rank {rep['rank']} ({name}): loss of step {step} is {got:.6f}, one process has {want:.6f}"
                + (": the forward already differs (positions, the attention's group, the experts' ranks)" if step == 0 else ""))
        bad = {n: d for n, d in rep["grad_diff"].items() if not d <= GRAD_ATOL}
        assert not bad, (
            f"rank {rep['rank']} ({name}): the first step's gradients differ from one process's for "
            f"{sorted(bad)[:4]} (max {max(bad.values()):.2e}). "
            + ("The experts' gradients: they come from every ep rank's tokens (the dispatcher averages them "
               "over ep); their own FSDP unit on mesh['dp_replicate'] averages them over the replicas only."
               if all(".moe.experts." in n for n in bad) else
               "Averaged over the wrong ranks: FSDP over dp_shard x cp (HSDP with dp_replicate) reduces them "
               "over every rank of the batch."))
        worst = max(rep["param_diff"].values())
        assert worst <= PARAM_ATOL, f"rank {rep['rank']} ({name}): parameters differ by {worst:.2e} after 2 steps"


@pytest.mark.exercise("parallelize")
def test_traffic_where_it_belongs(results):
    """One step's collectives: the ring on cp, the all-to-alls and FSDP on dp_shard_cp, no group of every rank."""
    for rep in case(results, "dp_shard 2 x cp 2"):
        t = rep["traffic"]
        stray = {d: v["calls"] for d, v in t.items() if d not in ("cp", "dp_shard_cp=dp_cp")}
        assert not stray, (f"rank {rep['rank']}: collectives on {sorted(stray)}: {stray}; expected the ring on cp "
                           "and FSDP, the all-to-alls and the load on dp_shard_cp only")
        assert t.get("cp", {}).get("calls", {}).get("send", 0) > 0, f"rank {rep['rank']}: no ring on cp: {t}"
        fsdp = t.get("dp_shard_cp=dp_cp", {}).get("calls", {})
        assert fsdp.get("reduce_scatter", 0) >= 3 and fsdp.get("all_to_all", 0) >= 5, (
            f"rank {rep['rank']}: on dp_shard_cp one step made {fsdp}: FSDP reduce-scatters each unit's gradients "
            "there (2 blocks and the root) and the MoE layer's dispatch and combine run there")


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    run_worker(CASES)
