"""Lab 12 (where the time goes: what notebook 12's section 6 concludes): rank 0's profiled step
against the planner's terms and calls, the pipeline's idle time against its bubble, the share of the
step in matmuls, and what a rank's compute is made of; a library of lab 12 (no main of its own).
Inputs are lab12_trace's and lab12_plan's reports as the notebook holds them; each function returns
a typed result whose verdict can come out either way, and tests/test_lab12_capstone.py feeds each
the opposite case. The other sections' conclusions are labs/lab12_report.py's.
"""
from __future__ import annotations

from dataclasses import dataclass


def timeline_shares(traces: dict[int, dict]) -> list[dict]:
    """Each rank's profiled step: the share of each timeline category, and the step's length."""
    cats = sorted({k for t in traces.values() for k in t["timeline"]["totals_s"]})
    return [{"rank": rank, **{k: t["timeline"]["totals_s"].get(k, 0.0) / t["timeline"]["span_s"] for k in cats},
             "step ms (profiled)": 1e3 * t["timeline"]["span_s"] / t["timeline"]["steps"]} for rank, t in traces.items()]


@dataclass(frozen=True)
class MatmulShare:
    share: float           # of the profiled steps' span, on the main thread
    mostly_other: bool
    text: str


def matmul_share(line: dict) -> MatmulShare:
    """How much of a rank's profiled step its matmul kernels took (the timeline's "matmul_s"):
    under half, and most of the step is other work (the operators around them, communication,
    waiting), or not."""
    share = line["matmul_s"] / line["span_s"]
    return MatmulShare(share, share < 0.5, f"matmul kernels took {share:.1%} of rank 0's profiled step: "
                       + ("most of the step is not matmuls" if share < 0.5 else "most of the step is matmuls"))


@dataclass(frozen=True)
class PlannerVsTrace:
    terms: list[dict]
    calls: list[dict]
    biggest: str
    gap_ms: float
    text: str


PAIRS = (("compute", ["compute"], ["compute"]), ("tp communication", ["tp_comm"], ["tp communication"]),
         ("dp communication", ["dp_comm"], ["dp communication"]),
         ("pipeline: messages and idle", ["pp_comm", "bubble"], ["pp communication", "pipeline idle"]),
         ("other communication", [], ["world communication", "other communication"]))


def planner_vs_trace(step: dict, prediction: dict, line: dict, call_s: float) -> PlannerVsTrace:
    """The planner's terms against rank 0's trace, per step (the trace scaled to the unprofiled
    step), the calls of one step against the planner's count (FSDP2's per unit, and notebook 09's
    ZeRO-3 per micro-batch beside it), and the term that differs most."""
    from labs.lab12_plan import StepMeasurement

    step = StepMeasurement(**step)
    terms = prediction["time"]
    per_step = {k: v / line["steps"] for k, v in line["totals_s"].items()}
    span = line["span_s"] / line["steps"]
    scale = step.step_s / span
    rows = []
    for name, planned_keys, traced_keys in PAIRS:
        planned, traced = 1e3 * sum(terms[k] for k in planned_keys), 1e3 * sum(per_step.get(k, 0.0) for k in traced_keys)
        if planned or traced:
            rows.append({"term": name, "planner ms": planned, "trace ms (profiled)": traced,
                         "trace ms, scaled to the measured step": traced * scale})
    rows.append({"term": "the step", "planner ms": 1e3 * prediction["step_s"], "trace ms (profiled)": 1e3 * span,
                 "trace ms, scaled to the measured step": 1e3 * step.step_s})
    measured, planned = step.calls, step.planner_calls
    calls = [{"dimension": d, "calls in one step (rank 0)": measured.get(d, 0), "calls the planner counts": planned.get(d, 0)}
             for d in sorted(set(measured) | set(planned) - {"zero3"}) if measured.get(d) or planned.get(d)]
    gaps = {r["term"]: r["trace ms, scaled to the measured step"] - r["planner ms"] for r in rows[:-1]}
    total_gap = 1e3 * (step.step_s - prediction["step_s"])
    biggest = max(gaps, key=lambda k: abs(gaps[k]))
    extra = sum(measured.values()) - sum(v for k, v in planned.items() if k != "zero3")
    text = (f"the measured step is {abs(total_gap):.0f} ms {'longer' if total_gap > 0 else 'shorter'} than predicted; the "
            f"term that differs most is {biggest}: {gaps[biggest]:+.0f} ms in the trace against the planner\n"
            f"calls: {sum(measured.values())} in one step on rank 0 against the {sum(measured.values()) - extra} the planner "
            f"counts ({extra:+d}: {extra * 1e3 * call_s:+.0f} ms at {1e3 * call_s:.2f} ms a call)"
            + (f"; on dp it counts FSDP2's {planned['dp']} calls (per unit and step) where notebook 09's ZeRO-3 term "
               f"counts {planned['zero3']} (per micro-batch): dp_comm {1e3 * terms['dp_comm']:.1f} ms against "
               f"{1e3 * terms.get('dp_comm_zero3', terms['dp_comm']):.1f} ms" if planned.get("zero3") else ""))
    return PlannerVsTrace(rows, calls, biggest, total_gap, text)


@dataclass(frozen=True)
class Bubble:
    planned_ms: float
    traced_ms: float
    noise_ms: float
    verdict: str           # "larger", "smaller" or "noise"
    text: str


def bubble(planned_s: float, line: dict, step_s: float, step_seconds: list[float]) -> Bubble:
    """The trace's pipeline idle time per step (rank 0's timeline `line`, scaled to the measured
    step `step_s`) against the planner's bubble: larger, smaller, or a difference within the run's
    own noise (the spread of the step's times over the timed rounds: the largest minus the
    smallest)."""
    traced_s = line["totals_s"].get("pipeline idle", 0.0) / line["span_s"] * step_s
    noise = max(step_seconds) - min(step_seconds)
    diff = traced_s - planned_s
    verdict = "noise" if abs(diff) <= noise else ("larger" if diff > 0 else "smaller")
    what = {"noise": "within the run's noise of", "larger": "larger than", "smaller": "smaller than"}[verdict]
    return Bubble(1e3 * planned_s, 1e3 * traced_s, 1e3 * noise, verdict,
                  f"the trace's pipeline idle time, {1e3 * traced_s:.0f} ms per step, is {what} the planner's bubble, "
                  f"{1e3 * planned_s:.0f} ms (the step's times spread over {1e3 * noise:.0f} ms across the rounds)")


@dataclass(frozen=True)
class CpuWork:
    rows: list[dict]
    busy: float
    cpu_bound: bool
    text: str


def cpu_work(steps: dict[int, dict], prediction: dict, machine: dict, flops_per_s: float, line: dict,
             nproc: int, cores: int) -> CpuWork:
    """What a rank's compute is made of (lab12_plan's CPU times, operator counts and DTensor's
    dispatch cost), and whether the ranks' CPU work fills the machine's cores (over 80%: the step is
    bound by it)."""
    from labs.lab12_plan import StepMeasurement

    steps = {rank: StepMeasurement(**m) for rank, m in steps.items()}
    s0 = steps[min(steps)]
    rows = [{"step": name, "wall ms": 1e3 * c["wall"], "CPU ms, this process": 1e3 * c["process_cpu"],
             "CPU ms, its main thread": 1e3 * c["thread_cpu"]} for name, c in s0.cpu.items()]
    composed, dense = s0.cpu["composed step"], s0.cpu["dense step"]
    d = s0.dispatch_s
    dtensor_ms = 1e3 * s0.dtensor_ops * (d["DTensor"] - d["plain"])
    total_cpu = sum(s.cpu["composed step"]["process_cpu"] for s in steps.values())
    wall = max(s.cpu["composed step"]["wall"] for s in steps.values())
    busy = total_cpu / (cores * wall)
    traced = line["totals_s"].get("compute", 0.0) / line["span_s"] * s0.step_s
    flops_rank0 = prediction["time"]["compute"] * flops_per_s
    text = "\n".join([
        f"FLOPs per rank the planner counts: {flops_rank0 / 1e6:.0f} M for rank 0's share of the composed step, "
        f"{machine['compute']['flops'] / 1e6:.0f} M for the dense step that calibrates its rate",
        f"CPU on rank 0's main thread: composed step {1e3 * composed['thread_cpu']:.0f} ms, dense step "
        f"{1e3 * dense['thread_cpu']:.1f} ms ({composed['thread_cpu'] / dense['thread_cpu']:.0f}x); it dispatched "
        f"{s0.ops:,} operators, {1e6 * composed['thread_cpu'] / s0.ops:.0f} us of main-thread CPU each; the dense "
        f"step {s0.dense_ops:,}, {1e6 * dense['thread_cpu'] / s0.dense_ops:.0f} us each",
        f"DTensor's dispatch: a small multiplication takes {1e6 * d['plain']:.1f} us of CPU on plain tensors, "
        f"{1e6 * d['DTensor']:.1f} us on DTensors; {s0.dtensor_ops:,} of the step's operators had a DTensor argument: "
        f"about {dtensor_ms:.0f} ms, {dtensor_ms / (1e3 * composed['thread_cpu']):.0%} of the main thread's CPU",
        f"all {nproc} ranks together used {total_cpu:.2f} CPU-seconds per composed step, on {cores} cores in {wall:.2f} s: "
        f"{busy:.0%} of the machine's CPU time" + (" (the step is bound by the CPU work of its ranks)" if busy > 0.8 else
                                                    " (the rest: the ranks waiting for each other, or other processes "
                                                    "on this machine)"),
        f"rank 0's main-thread CPU times the ranks per core, {1e3 * composed['thread_cpu']:.0f} ms x {nproc}/{cores} = "
        f"{1e3 * composed['thread_cpu'] * nproc / cores:.0f} ms, beside the trace's compute scaled to the step, "
        f"{1e3 * traced:.0f} ms; the planner's compute term: {1e3 * prediction['time']['compute']:.0f} ms"])
    return CpuWork(rows, busy, busy > 0.8, text)
