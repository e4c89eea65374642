"""Lab 09 (what notebook 09 concludes): the notebook's tables and verdicts, computed from the
launch's reports (labs/lab09_mesh.py, labs/lab09_sequence_parallel.py) and the planner, as typed
results; a library of lab 09 (no main of its own). A cell calls one of these, prints and plots; every verdict here can come out either way,
and tests/test_lab09_report.py feeds each the opposite case.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from helpers.notice import attempt

KiB = 2**10


# ===================================================================== section 1: the configurations
@dataclass(frozen=True)
class Configurations:
    rows: list[dict]
    unsolved: list[str]        # the exercise messages of configurations that could not run yet
    worst: float
    within: bool
    text: str


def configurations(mesh_res: dict[int, dict], tolerance: float) -> Configurations:
    """Every configuration that ran against one process (largest parameter difference on any rank)."""
    rows, unsolved = [], []
    for name, first in mesh_res[0]["configs"].items():
        runs = [mesh_res[rank]["configs"][name] for rank in sorted(mesh_res)]
        if "unsolved" in runs[0]:
            unsolved.append(runs[0]["unsolved"])
            continue
        rows.append({"configuration": name, "dp": first["dp"], "tp": first["tp"], "sequence parallel": first["sp"],
                     "max |param diff| vs one process": max(r["max_param_diff"] for r in runs),
                     "step ms (slowest rank)": 1e3 * runs[0]["step_s"]})
    worst = max((r["max |param diff| vs one process"] for r in rows), default=0.0)
    ran = f"{len(rows)} of {len(mesh_res[0]['configs'])} configurations ran"
    within = worst <= tolerance
    return Configurations(rows, unsolved, worst, within, (
        f"{ran}; all within the tolerance: largest difference {worst:.1e}" if within else
        f"{ran}; NOT all within the tolerance: largest difference {worst:.1e} > {tolerance:g}"))


# ===================================================================== section 2: sequence parallelism
@dataclass(frozen=True)
class Activations:
    rows: list[dict]
    measured_ratio: float      # tensor parallel / sequence parallel, measured
    formula_ratio: float
    text: str


def activations(s0: dict) -> Activations:
    """Activations per layer on rank 0 (lab09_sequence_parallel) against Korthikanti et al.'s
    count (selective recomputation, fp32, no dropout) for the dense, tp and sp stacks."""
    from labs.lab09_planner import activation_bytes_per_layer

    sizes, t = s0["sizes"], s0["tp_size"]

    def formula(tp, seq_par):
        return activation_bytes_per_layer(sizes["seq"], sizes["batch"], sizes["d_model"], sizes["heads"], tp=tp,
                                          sequence_parallel=seq_par, recompute="selective", element_bytes=4, dropout=False)
    cases = (("dense, one rank", s0["dense_activation_bytes"], 1, False),
             (f"tensor parallel, t={t}", s0["tp"]["activation_bytes"], t, False),
             (f"+ sequence parallel, t={t}", s0["sp"]["activation_bytes"], t, True))
    rows = [{"model": name, "measured KiB per layer (rank 0)": measured / KiB, "formula KiB": formula(tp, sp) / KiB,
             "measured / formula": measured / formula(tp, sp)} for name, measured, tp, sp in cases]
    measured = s0["tp"]["activation_bytes"] / s0["sp"]["activation_bytes"]
    expected = formula(t, False) / formula(t, True)
    return Activations(rows, measured, expected, f"sequence parallelism keeps {measured:.2f}x less than tensor "
                       f"parallelism alone here; the formula says {expected:.2f}x")


@dataclass(frozen=True)
class SpTraffic:
    rows: list[dict]
    unsolved: list[str]
    text: str


def sp_traffic(s0: dict) -> SpTraffic:
    """The collectives of one forward and one backward of the tp and sp stacks (the traffic
    meter), and sequence parallelism's bytes and calls against tensor parallelism's."""
    rows, unsolved, found = [], [], {}
    for kind, label in (("tp", "tensor parallel"), ("sp", "sequence parallel")):
        calls = s0[kind]["collectives"]
        if "unsolved" in calls:
            unsolved.append(calls["unsolved"])
            continue
        found[kind] = calls
        rows += [{"scheme": label, "phase": phase, "collectives": ", ".join(f"{n} {k}" for k, n in sorted(calls[phase]["calls"].items())),
                  "KiB sent by this rank": calls[phase]["sent_bytes"] / KiB} for phase in ("forward", "backward")]
    if len(found) < 2:
        return SpTraffic(rows, unsolved, "")
    sent = {(kind, phase): found[kind][phase]["sent_bytes"] for kind in found for phase in ("forward", "backward")}
    issued = {kind: sum(sum(found[kind][phase]["calls"].values()) for phase in ("forward", "backward")) for kind in found}
    return SpTraffic(rows, unsolved, (
        f"sequence parallel / tensor parallel: bytes sent forward {sent['sp', 'forward'] / sent['tp', 'forward']:.2f}x, "
        f"backward {sent['sp', 'backward'] / sent['tp', 'backward']:.2f}x; collectives issued {issued['sp']} against "
        f"{issued['tp']} ({issued['sp'] / issued['tp']:.1f}x)"))


def dtensor_check(d: dict, tolerance: float) -> str:
    """DTensor's SequenceParallel against ours: within the tolerance or not."""
    return (f"largest difference {d['worst']:.1e}: " + ("within" if d["worst"] <= tolerance else "NOT within")
            + f" the tolerance {tolerance:g}")


# ================================================================== section 4.1: this machine
@dataclass(frozen=True)
class Machine:
    sweep: list[dict]
    back_to_back: list[dict]
    in_step: list[dict]
    text: str


CHAINS = {"tp": "tensor parallelism's", "sp": "sequence parallelism's", "dp": "DDP's all-reduce"}


def machine(m: dict, sizes: dict) -> Machine:
    """What lab09_machine measured, as the planner sees it: the sweep behind the all-reduce's fit,
    small calls back to back and inside a step, and the lines that compare them."""
    ab, calls, compute = m["all_reduce"], m["calls"], m["compute"]
    sweep = [{"bytes": r["bytes"], "measured us": 1e6 * r["seconds"], "fit us": 1e6 * (ab["latency_s"] + r["bytes"] / ab["algbw"])}
             for r in ab["rows"]]
    b2b_rows = [{"call": r["kind"], "ranks": r["group size"], "ms per call": 1e3 * r["seconds per call"]}
                for r in calls["back_to_back"]]
    in_step = [{"added to the step": CHAINS[r["chain"]], "ranks": r["group size"],
                "calls": r["calls"] if r["fitted"] else "1 (+ the wait)", "measured ms per call": 1e3 * r["seconds per call"],
                "model ms per call": 1e3 * r["fit per call"] if r["fitted"] else "-"} for r in calls["in_step"]]
    b2b = {(r["kind"], r["group size"]): r["seconds per call"] for r in calls["back_to_back"]}
    n = ab["ranks"]
    in_step_ar = calls["call_s"] + 2 * (n - 1) * calls["step_s"]
    lines = [
        f"dense stack's training step on {compute['rows']} of {sizes['batch']} sequences, all ranks busy: "
        f"{1e3 * compute['plain_seconds']:.1f} ms alone, {1e3 * compute['seconds']:.1f} ms with the one wait for the "
        f"slowest rank every distributed step has: {compute['flops_per_s'] / 1e9:.2f} GFLOP/s per rank",
        f"all-reduce on {n} ranks, back to back: latency {ab['latency_s'] * 1e6:.0f} us ({ab['step_latency_s'] * 1e6:.0f} us "
        f"per ring step), bus bandwidth {ab['busbw'] / 1e9:.2f} GB/s",
        f"fixed cost of a call in a step: call_s = {1e3 * calls['call_s']:.2f} ms + step_s = {1e3 * calls['step_s']:.2f} ms "
        f"per ring step; the one wait for the slowest rank: {1e3 * calls['wait_s']:.1f} ms per step",
        f"a small all-reduce on {n} ranks: {1e3 * b2b['all_reduce', n]:.2f} ms back to back, {1e3 * in_step_ar:.2f} ms "
        f"in a step by the fit ({in_step_ar / b2b['all_reduce', n]:.1f}x); the sweep's alpha gave "
        f"{1e3 * 2 * (n - 1) * max(0.0, ab['step_latency_s']):.2f} ms",
        f"back to back, a reduce-scatter costs {b2b['reduce_scatter', n] / b2b['all_gather', n]:.1f}x an all-gather and "
        f"{b2b['reduce_scatter', n] / b2b['all_reduce', n]:.1f}x an all-reduce on {n} ranks here (a ring takes as long "
        "for either of the first two; gloo runs a reduce-scatter as an all-reduce)"]
    return Machine(sweep, b2b_rows, in_step, "\n".join(lines))


def collectives_per_step(config, layers: int) -> int:
    """What one step of a section-1 configuration issues: the tensor-parallel collectives of every
    layer, sequence parallelism's gradient sum of the layer norms, DDP's gradient all-reduce (one
    bucket: the stack is small)."""
    from labs.lab09_planner import tp_collectives_per_layer

    per_layer = sum(len(k) for k in tp_collectives_per_layer(config).values()) if config.tp > 1 else 0
    return layers * per_layer * config.micro_batches + config.sequence_parallel + (config.dp > 1)


@dataclass(frozen=True)
class Validation:
    rows: list[dict]
    unsolved: list[str] = field(default_factory=list)


def validation(mesh_res: dict[int, dict], model, cluster, before) -> Validation:
    """Each configuration that ran, predicted (with and without the fixed cost of a call,
    `before`) beside what it measured: step time, its parts, memory. Needs the planner exercise."""
    from labs import lab09_mesh as mesh_lab
    from labs import lab09_planner as planner

    free_bytes = replace(cluster, intra_bytes_per_s=float("inf"), inter_bytes_per_s=float("inf"))
    rows, unsolved = [], []
    for name in mesh_res[0]["configs"]:
        run = mesh_res[0]["configs"][name]
        if "unsolved" in run:
            unsolved.append(run["unsolved"])
            continue
        config = mesh_lab.lab_config(run)
        plans = attempt(lambda: (planner.plan_step_time(model, cluster, config), planner.plan_step_time(model, free_bytes, config),
                                 planner.plan_memory(model, config), planner.plan_step_time(model, before, config)))
        if isinstance(plans, dict):
            unsolved.append(plans["unsolved"])
            continue
        time_plan, fixed, memory_plan, old = plans
        states = memory_plan.parameters + memory_plan.gradients + memory_plan.optimizer_state
        comm, fixed_comm = time_plan.tp_comm + time_plan.dp_comm, fixed.tp_comm + fixed.dp_comm
        rows.append({"configuration": name, "measured ms": 1e3 * run["step_s"], "predicted ms": 1e3 * time_plan.total,
                     "predicted / measured": time_plan.total / run["step_s"],
                     "before: predicted / measured": old.total / run["step_s"],
                     "of which compute ms": 1e3 * time_plan.compute, "of which fixed cost of calls ms": 1e3 * fixed_comm,
                     "of which bytes ms": 1e3 * (comm - fixed_comm),
                     "collectives per step": collectives_per_step(config, model.layers),
                     "states: predicted / measured": states / run["held"]["total"],
                     "activations: predicted / measured": memory_plan.activations / run["activation_bytes"]})
    return Validation(rows, sorted(set(unsolved)))


def validation_verdict(rows: list[dict], within: float = 1.3) -> str:
    """Whether every configuration's step came within `within` x of the prediction, with and
    without the fixed cost of a call; where that cost weighs most; memory's ratios."""
    ratios = {r["configuration"]: r["predicted / measured"] for r in rows}
    before = [r["before: predicted / measured"] for r in rows]
    outside = [name for name, ratio in ratios.items() if not 1 / within <= ratio <= within]
    states = [r["states: predicted / measured"] for r in rows]
    acts = [r["activations: predicted / measured"] for r in rows]
    most = max(rows, key=lambda r: r["of which fixed cost of calls ms"] / r["predicted ms"])
    return "\n".join([
        f"Step time, predicted / measured: {min(ratios.values()):.2f} to {max(ratios.values()):.2f} over {len(ratios)} "
        "configurations: " + (f"within {within}x for every one." if not outside else
                              f"NOT within {within}x for {', '.join(outside)} on this run."),
        f"Without the fixed cost of a call (as the planner was before): {min(before):.2f} to {max(before):.2f}.",
        f"The calls' fixed cost is the largest share of the prediction for {most['configuration']}: "
        f"{most['of which fixed cost of calls ms']:.1f} of {most['predicted ms']:.1f} ms, for {most['collectives per step']} "
        f"collectives per step; their bytes take {max(r['of which bytes ms'] for r in rows):.1f} ms at most.",
        f"Memory, predicted / measured: model states {min(states):.4g} to {max(states):.4g}"
        f"{' (exact)' if all(x == 1 for x in states) else ''}, activations {min(acts):.3f} to {max(acts):.3f}."])


# ========================================================================= section 4.2-4.4: at scale
@dataclass(frozen=True)
class AtScale:
    axes: list[dict]
    nb05: list[dict]
    text: str


def at_scale(model, cluster, layout, plain, nb05_traffic: dict) -> AtScale:
    """Where each parallelism's bytes go for `model` on `cluster` in `layout` (the planner's
    `axis_rows`), tensor parallelism inside a node and across nodes, and the planner's bytes
    against notebook 05's `step_traffic` for the same model without sequence parallelism
    (`plain`). Needs the planner exercise."""
    from labs import lab09_at_scale as scale
    from labs import lab09_planner as planner

    axes = scale.axis_rows(model, cluster, layout)
    inside = planner.plan_step_time(model, cluster, layout)
    across = planner.plan_step_time(model, scale.with_tp_across_nodes(layout, cluster), layout)
    ours = planner.plan_step_time(model, cluster, plain)
    nb05 = [{"axis": axis, "notebook 05's step_traffic GB": nb05_traffic[key]["bytes"] / 1e9, "planner GB": mine / 1e9,
             "planner / notebook 05": mine / nb05_traffic[key]["bytes"]}
            for axis, key, mine in (("tensor", "tensor parallel", ours.tp_bytes), ("pipeline", "pipeline parallel", ours.pp_bytes),
                                    ("data", "data parallel", ours.dp_bytes))]
    volumes = sorted(axes, key=lambda r: -r["GB sent per GPU per step"])
    first, second, third = (v["GB sent per GPU per step"] for v in volumes)
    return AtScale(axes, nb05, "\n".join([
        f"tensor-parallel time per step: {inside.tp_comm:.2f} s over NVLink; {across.tp_comm:.2f} s if the tp group "
        f"crossed InfiniBand ({across.tp_comm / inside.tp_comm:.0f}x), against {inside.compute:.2f} s of compute",
        f"the most bytes: {volumes[0]['axis']} parallelism, {first:.3g} GB per GPU per step ({first / second:.1f}x "
        f"{volumes[1]['axis']}, {first / third:.0f}x {volumes[2]['axis']}), over the link {volumes[0]['link']}"]))


def published(rows: list[dict], assumed_efficiency: float) -> str:
    """The planner against Narayanan et al.'s table 1: how far, where it predicts more, and whether
    each throughput rises with model size."""
    ratios = [r["predicted / published"] for r in rows]
    above = sum(ratio > 1 for ratio in ratios)
    worst = max(rows, key=lambda r: r["predicted / published"])
    best = min(rows, key=lambda r: r["predicted / published"])
    first, last = rows[0], rows[-1]

    def trend(key):
        return "rises" if last[key] > first[key] else "does not rise"
    return "\n".join([
        f"predicted / published: {min(ratios):.2f} to {max(ratios):.2f}; the matmul efficiency that would match each row: "
        f"{min(r['efficiency that matches'] for r in rows):.2f} to {max(r['efficiency that matches'] for r in rows):.2f} "
        f"(assumed: {assumed_efficiency})",
        f"the planner predicts more than was published for {above} of {len(rows)} rows; most for {worst['model']} "
        f"({worst['predicted / published']:.2f}), least for {best['model']} ({best['predicted / published']:.2f})",
        f"from {first['model']} to {last['model']}: published TFLOP/s per GPU {first['published TFLOP/s/GPU']} -> "
        f"{last['published TFLOP/s/GPU']} ({trend('published TFLOP/s/GPU')}), predicted {first['predicted TFLOP/s/GPU']:.0f} -> "
        f"{last['predicted TFLOP/s/GPU']:.0f} ({trend('predicted TFLOP/s/GPU')})"])


# ================================================================================ section 5: explore
def explorer_view(r: dict, memory_gb: float) -> list:
    """The explorer's panel for `scale.explore`'s result `r`: the model, the layout and its links
    (no exercise needed), then the planner's memory and step time as far as its exercises are
    written (a notice for each one that is not), and, with both, the summary."""
    import matplotlib.pyplot as plt

    from helpers.notice import notice_html
    from helpers.show import html_figure, html_table, html_text

    if r["error"]:
        return [html_text(f"does not split: {r['error']}")]
    c, sched_info, m = r["config"], r["schedule"], r["model"]
    layout = [html_text(
        f"{m['name']}: {m['parameters'] / 1e9:.1f}B parameters, {m['heads']} heads, {m['seq']}-token sequences, "
        f"{m['global batch']} sequences ({m['global batch'] * m['seq'] / 1e6:.2f}M tokens) per training step\n"
        f"dp={c['dp']} x tp={c['tp']} x pp={c['pp']}, m={c['micro_batches']} micro-batches of 1 sequence per replica, "
        f"{c['schedule']}" + (f" with v={c['virtual_stages']}" if c["virtual_stages"] > 1 else "") +
        (f": the simulated bubble is {sched_info['bubble / ideal']:.1%} of the ideal time (t_B = 2 t_F, free messages), "
         f"stage 0 holds {sched_info['held on stage 0']:g} micro-batches" if c["pp"] > 1 else ": no pipeline, no bubble")),
        html_table(r["links"], floatfmt=".3g")]
    parts = [(key, title, ylabel) for key, title, ylabel in
             [("memory", f"memory per GPU (dashed: {memory_gb:g} GB)", "GB per GPU"),
              ("time", "one training step", "seconds per step")] if key in r]
    figures = []
    if parts:
        fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 3), squeeze=False)
        for ax, (key, title, ylabel) in zip(axes[0], parts):
            ax.bar(list(r[key]), list(r[key].values()))
            ax.set(ylabel=ylabel, title=title)
            ax.tick_params(axis="x", labelrotation=25)
            if key == "memory":
                ax.axhline(memory_gb, color="gray", linestyle="--")
        fig.tight_layout()
        figures.append(html_figure(fig))
    notices = [notice_html(message) for message in r.get("unsolved", [])]
    if "summary" not in r:
        return layout + figures + notices
    s = r["summary"]
    return layout + figures + [html_text(
        f"{s['GB per GPU']:.1f} GB per GPU ({'fits' if s['fits'] else 'does NOT fit'}), {s['step s']:.2f} s per "
        f"training step, MFU {s['MFU']:.0%}, {s['tokens/s'] / 1e6:.2f}M tokens/s")]
