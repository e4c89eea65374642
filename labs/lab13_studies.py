"""Lab 13 (the notebook's launch): the composed 5-D run and the studies around it, on one process
group, each part's result reported under its name ({"unsolved": ...} while `parallelize` is a
stub).

Run:  ./run.sh 13      (alone: ./run.sh labs/lab13_studies.py, on 8 ranks, or with --ranks 4 on the
                        4-rank meshes; the notebook runs it on 8 ranks, 4 in smoke mode)

Parts (`MESHES` says which mesh each uses on 8 and on 4 ranks):
- "composed": the grown-up model on the 5-D mesh against one process, then training on;
- "pipelined": the pp variant against one process, and FSDP under the pipeline with and without
  `reshard_after_forward`: the peak bytes during a step, the parameters held between forwards
  and the all-gathers (`reshard_study`);
- "hsdp": HSDP against plain FSDP on the same ranks: bytes per step by dimension, and the bytes
  whose group crosses the boundary between the two halves of the ranks, where a replica ends
  (`hsdp_study`);
- "cp": ring and Ulysses, for multi-head and grouped-query attention, one step each: the bytes on
  the cp dimension, counted, beside the planner's count (`cp_study`);
- "chooser": this machine measured, every layout of the ranks ranked (labs/lab13_planner.py), the
  top two run alternately, and whether the ranking held (`chooser`).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from labs.lab13_model import check_model, corpus, default_config, split
from labs.lab13_chooser import chooser
from labs.lab13_train import Trainer, check_run, traffic_meter

PEAK_SAME = 0.02     # peaks within 2% of each other: the same (the allocator's and gloo's buffers)
MESHES = {
    8: {"composed": {"dp_shard": 2, "cp": 2, "tp": 2}, "pipelined": {"pp": 2, "dp_shard": 2, "cp": 2},
        "hsdp": {"dp_replicate": 2, "dp_shard": 2, "cp": 2}, "flat": {"dp_shard": 4, "cp": 2},
        "cp": {"dp_shard": 4, "cp": 2}},
    4: {"composed": {"cp": 2, "tp": 2}, "pipelined": {"pp": 2, "cp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2},
        "flat": {"dp_shard": 4}, "cp": {"dp_shard": 2, "cp": 2}},
}


def meshes(world_size: int) -> dict:
    if world_size not in MESHES:
        raise ValueError(f"lab 13's studies run on 4 or 8 ranks (NPROC=4 or 8), not {world_size}")
    return MESHES[world_size]


def axes(sizes: dict) -> list[str]:
    """The dimensions a run exercises: those of size > 1, and ep (dp_shard x cp) and FSDP's."""
    used = [d for d, n in sizes.items() if n > 1]
    ep = sizes.get("dp_shard", 1) * sizes.get("cp", 1)
    return used + ([f"ep {ep} (= dp_shard x cp)"] if ep > 1 else [])


# ============================================================================ FSDP under pp
def reshard_study(ctx: DistContext, sizes: dict, config=None) -> dict:
    """The pipelined mesh with reshard_after_forward False (torchtitan's choice with pp) and
    True: for one step after a warm-up one, this rank's peak bytes allocated during the step, the
    parameter bytes its stage holds after its first micro-batch's forward (until the next one),
    its all-gathers on FSDP's dimension and the step's time."""
    from helpers.accounting import held_bytes
    from labs.lab13_grouped_gemm import peak_bytes
    from labs.lab13_planner import dimension_label, relabel

    config = config or default_config()
    data, _ = split(corpus())
    fsdp = dimension_label("dp_shard_cp", sizes)
    out = {}
    for reshard in (False, True):
        trainer = Trainer(ctx, config, sizes, reshard_after_forward=reshard)
        trainer.step(data, 0)
        meter, between = traffic_meter(trainer.mesh), {}

        def after_forward(module, args, output):      # FSDP's own hook has run: resharded or not
            between.setdefault("bytes", held_bytes({"p": module.parameters()})["total"])
        handle = trainer.model.register_forward_hook(after_forward)
        ctx.barrier()
        start = time.perf_counter()
        with meter:
            peak = peak_bytes(lambda: trainer.step(data, 1))
        seconds = time.perf_counter() - start
        handle.remove()
        traffic = relabel(meter.summary(), trainer.sizes)
        out[str(reshard)] = {"peak_bytes": peak, "all_gathers": traffic.get(fsdp, {}).get("calls", {}).get("all_gather", 0),
                             "between_forwards": between.get("bytes", 0), "seconds": seconds, "stage": trainer.pp_rank}
        del trainer
    return out


def reshard_verdict(rows: dict) -> dict:
    """From every rank's `reshard_study` ({rank: {"False": ..., "True": ...}}): per rank the peak
    with reshard_after_forward False over the peak with True, and the all-gathers of each; "keeps
    more" if False held more than PEAK_SAME above on every rank, "keeps less" if that much less on
    every rank, "about the same" if within it on every rank, else "mixed"."""
    ratios = {r: v["False"]["peak_bytes"] / max(v["True"]["peak_bytes"], 1) for r, v in rows.items()}
    gathers = {r: (v["False"]["all_gathers"], v["True"]["all_gathers"]) for r, v in rows.items()}
    low, high = min(ratios.values()), max(ratios.values())
    outcome = ("keeps more" if low > 1 + PEAK_SAME else "keeps less" if high < 1 - PEAK_SAME
               else "about the same" if 1 - PEAK_SAME <= low and high <= 1 + PEAK_SAME else "mixed")
    fewer = all(off < on for off, on in gathers.values())
    between = {r: (v["False"]["between_forwards"], v["True"]["between_forwards"]) for r, v in rows.items()}
    return {"outcome": outcome, "peak_ratio": ratios, "all_gathers": gathers, "fewer_gathers": fewer,
            "between_forwards": between, "holds_more_between": all(off > on for off, on in between.values())}


def reshard_sentence(v: dict) -> str:
    """`reshard_verdict` in words."""
    low, high = min(v["peak_ratio"].values()), max(v["peak_ratio"].values())
    off = sum(a for a, _ in v["all_gathers"].values())
    on = sum(b for _, b in v["all_gathers"].values())
    peak = {"keeps more": "held more at its peak on every rank", "keeps less": "held less at its peak on every rank",
            "about the same": f"reached the same peak within {PEAK_SAME:.0%} on every rank",
            "mixed": "held more at the peak on some ranks and less on others"}[v["outcome"]]
    kept = sum(a for a, _ in v["between_forwards"].values()) / 2**10
    freed = sum(b for _, b in v["between_forwards"].values()) / 2**10
    return (f"reshard_after_forward=False {peak} (peak ratio {low:.3f} to {high:.3f}); between a micro-batch's "
            f"forward and the next, the ranks held {kept:.0f} KiB of parameters against {freed:.0f} KiB with True"
            + ("" if v["holds_more_between"] else " (not more on every rank)")
            + f"; {off} all-gathers on FSDP's dimension against {on}" + ("" if v["fewer_gathers"] else " (not fewer on every rank)"))


# ============================================================================ HSDP
def crosses(label: str, sizes: dict) -> bool:
    """Whether the groups named `label` (a `dimension_label`) hold ranks of both halves of the
    ranks: on a cluster, with the halves on two nodes (or two replicas), their bytes cross."""
    from labs.lab13_planner import BASE, DIMS

    names = [n for n in label.split("=") if n in BASE]
    if not names:
        return True               # a group the table cannot name: counted as crossing
    shape = [sizes.get(d, 1) for d in DIMS]
    grid = torch.arange(math.prod(shape)).reshape(shape)    # ranks in the mesh's order
    varying = [i for i, d in enumerate(DIMS) if d in BASE[names[0]] and shape[i] > 1]
    if not varying:
        return False
    fixed = [i for i in range(len(DIMS)) if i not in varying]
    groups = grid.permute(*fixed, *varying).reshape(-1, math.prod(shape[i] for i in varying))
    half = grid.numel() // 2
    return bool(((groups < half).any(1) & (groups >= half).any(1)).any())


def hsdp_study(ctx: DistContext, hsdp: dict, flat: dict, config=None) -> dict:
    """One checked step of each layout (after a warm-up one), its traffic by dimension, and the
    bytes this rank sent on groups that cross the halves."""
    out = {}
    for name, sizes in (("hsdp", hsdp), ("flat", flat)):
        run = check_run(ctx, sizes, config=config, steps=2, traffic_step=1)
        crossing = sum(t["sent_bytes"] for d, t in run["traffic"].items() if crosses(d, sizes))
        out[name] = {"sizes": sizes, "traffic": run["traffic"], "crossing_bytes": crossing,
                     "total_bytes": sum(t["sent_bytes"] for t in run["traffic"].values()),
                     "max_loss_rel_diff": run["max_loss_rel_diff"], "max_param_diff": run["max_param_diff"]}
    return out


def hsdp_verdict(rows: dict) -> dict:
    """From every rank's `hsdp_study`: the bytes crossing the halves, HSDP's over plain FSDP's,
    summed over the ranks; "less" / "more" / "same"."""
    h = sum(r["hsdp"]["crossing_bytes"] for r in rows.values())
    f = sum(r["flat"]["crossing_bytes"] for r in rows.values())
    ratio = h / f if f else float("inf")
    return {"hsdp_crossing": h, "flat_crossing": f, "ratio": ratio,
            "outcome": "less" if h < f else "more" if h > f else "same"}


def hsdp_sentence(v: dict) -> str:
    """`hsdp_verdict` in words."""
    if v["outcome"] == "same":
        return "HSDP and plain FSDP sent the same bytes across the halves"
    return (f"across the two halves of the ranks, HSDP sent {v['hsdp_crossing'] / 2**20:.2f} MiB a step, plain "
            f"FSDP {v['flat_crossing'] / 2**20:.2f} MiB: {v['ratio']:.2f}x, {v['outcome']}")


# ============================================================================ ring vs Ulysses
def cp_study(ctx: DistContext, sizes: dict, config=None) -> list[dict]:
    """Ring and Ulysses with kv_heads = heads (multi-head) and the model's kv heads (grouped): one
    checked step each; the bytes that left this rank on the cp dimension (`left`), and the
    planner's count."""
    from labs.lab13_planner import Layout, MoEShape, dimension_label, per_dimension, step_calls

    config = config or default_config()
    label = dimension_label("cp", sizes)
    rows = []
    for kv_heads, design in itertools.product((config.heads, config.kv_heads), ("ring", "ulysses")):
        cfg = replace(config, kv_heads=kv_heads)
        run = check_run(ctx, sizes, config=cfg, steps=1, design=design, traffic_step=0)
        layout = Layout(**{k: v for k, v in sizes.items()})
        planned = per_dimension(step_calls(layout, MoEShape.from_config(cfg), design=design), layout.sizes)
        rows.append({"attention": "multi-head" if kv_heads == config.heads else f"grouped ({kv_heads} kv heads)",
                     "kv_heads": kv_heads, "design": design, "sent": left(run["traffic"].get(label, {}), sizes["cp"]),
                     "planned": planned.get(label, {}).get("sent", 0.0), "ok": run["max_loss_rel_diff"] < 1e-4})
    return rows


def left(traffic: dict, n: int) -> float:
    """Bytes that left this rank, from a dimension's sizes (`bytes[kind]`): a message's all of it,
    an all-to-all's (n-1)/n (even splits, as Ulysses' are: a rank's own block stays)."""
    sizes = traffic.get("bytes", {})
    return sizes.get("send", 0) + sizes.get("all_to_all", 0) * (n - 1) / n


def gqa_effect(rows: list[dict]) -> dict:
    """Per design, multi-head bytes over grouped-query bytes (from `cp_study`'s rows), and which
    design sent less in each case."""
    by = {(r["design"], r["kv_heads"]): r["sent"] for r in rows}
    heads = max(r["kv_heads"] for r in rows)
    kv = min(r["kv_heads"] for r in rows)
    out = {design: by[(design, heads)] / max(by[(design, kv)], 1) for design in ("ring", "ulysses")}
    out["less"] = {case: min(("ring", "ulysses"), key=lambda d: by[(d, n)]) for case, n in (("multi-head", heads),
                                                                                             ("grouped", kv))}
    return out


def gqa_sentence(effect: dict) -> str:
    """`gqa_effect` in words."""
    return (f"going from multi-head to grouped-query attention cut the ring's bytes on cp by {effect['ring']:.2f}x "
            f"and Ulysses' by {effect['ulysses']:.2f}x; the design that sent less: {effect['less']['multi-head']} "
            f"with multi-head attention, {effect['less']['grouped']} with grouped-query attention")


# ============================================================================ the run
PARTS = ("composed", "pipelined", "reshard", "hsdp", "cp", "chooser")


def unsolved(world_size: int, message: str) -> dict:
    """What `run` would report on every rank while `parallelize` is its stub (every part needs it),
    without launching anything: the notebook shows the notices and goes on."""
    m = meshes(world_size)
    one = {"meshes": m, "axes": {k: axes(v) for k, v in m.items()}, "seconds": {p: 0.0 for p in PARTS},
           **{part: {"unsolved": message} for part in PARTS}}
    return {rank: one for rank in range(world_size)}


@dataclass(frozen=True)
class Run(runs.Run):
    """The launch: `parts` (of PARTS) on the meshes of the ranks (MESHES: 8, or 4), the model
    `model` (lab13_model.MODELS), the composed run's `steps` (the first `check_steps` checked
    against one process) and the chooser's timed `rounds` per layout."""
    model: str = "full"
    steps: int = 30
    check_steps: int = 4
    rounds: int = 4
    parts: tuple[str, ...] = PARTS
    ranks: int | None = 8
    SMOKE = dict(model="smoke", steps=3, check_steps=3, rounds=2, ranks=4)
    # ./run.sh's tour: HSDP's bytes alone (lab13_train's tour runs the composed run)
    TOUR = {**SMOKE, "parts": ("hsdp",)}
    EXACT_RANKS = True

    def __post_init__(self):
        check_model(self.model)
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ValueError(f"--parts: no part(s) {unknown}; the parts are {', '.join(PARTS)}")
        if self.ranks not in MESHES:
            raise ValueError(f"lab 13's studies run on 4 or 8 ranks, not {self.ranks}")


def run(ctx: DistContext, cfg: Run) -> dict:
    """cfg's parts on this world size's meshes (`MESHES`), each under `attempt`."""
    m = meshes(ctx.world_size)
    config = default_config(cfg.model)
    plan = {
        "composed": lambda: check_run(ctx, m["composed"], config=config, steps=cfg.steps, check_steps=cfg.check_steps),
        "pipelined": lambda: check_run(ctx, m["pipelined"], config=config, steps=3),
        "reshard": lambda: reshard_study(ctx, m["pipelined"], config),
        "hsdp": lambda: hsdp_study(ctx, m["hsdp"], m["flat"], config),
        "cp": lambda: cp_study(ctx, m["cp"], config),
        "chooser": lambda: chooser(ctx, cfg.rounds, config),      # labs/lab13_chooser.py
    }
    out = {"meshes": m, "axes": {k: axes(v) for k, v in m.items()}}
    for part in cfg.parts:
        start = time.perf_counter()
        out[part] = attempt(plan[part])
        out.setdefault("seconds", {})[part] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(**out)
        if ctx.rank == 0:
            print({part: f"{s:.1f} s" for part, s in out["seconds"].items()}, flush=True)
            composed = out.get("composed", {"unsolved": "not run"})
            if "unsolved" not in composed:
                print(f"{composed['layout']}: losses {[round(v, 3) for v in composed['losses']]}", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
