"""Lab 12 (what notebook 12 concludes): the notebook's tables and verdicts, computed from what its
launches reported, as typed results; a library of lab 12 (no main of its own). A cell calls one of these, prints and plots; every verdict
here can come out either way, and tests/test_lab12_capstone.py feeds each the opposite case.

Inputs are the launches' reports as the notebook holds them: `{rank: report}` of lab12_train,
lab12_clipping, lab12_memory (helpers/launch/run_labs.py) and of lab12_resume's launch. What
section 6 concludes about where the time goes (lab12_trace, lab12_plan) is labs/lab12_time_report.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KiB = 2**10


def first_rank_of_each_stage(reports: dict[int, dict]) -> dict[int, int]:
    """{pipeline stage: the lowest rank on it}, from each report's "coordinate"."""
    stages: dict[int, int] = {}
    for rank, r in sorted(reports.items()):
        stages.setdefault(r["coordinate"]["pp"], rank)
    return stages


# ===================================================================================== the layout
@dataclass(frozen=True)
class Layout:
    smallest: int          # parameter bytes on the rank holding least
    largest: int
    total: int             # over every rank
    whole: int             # the whole model's
    two_d: int             # rank 0's parameters that are 2-D DTensors on (dp, tp)
    parameters: int        # rank 0's parameters
    text: str


def layout(held: list[int], whole: int, placements: dict, tp: int, nproc: int) -> Layout:
    """What the ranks hold against the whole model: each rank's parameter bytes `held`, rank 0's
    `placements` (lab12_parallelize's layout_demo)."""
    total, two_d = sum(held), sum(e["mesh"] == ["dp", "tp"] for e in placements.values())
    text = (f"parameter bytes per rank: {min(held):,} to {max(held):,}, against {whole:,} for the whole model "
            f"({max(held) / whole:.3f} of it at most; 1/{nproc} = {1 / nproc:.3f}); all ranks together hold "
            f"{total:,} bytes, {total / whole:.3f}x the model"
            + (" (the norms' weights are whole on every tp rank, and FSDP pads uneven shards)" if total > whole else ""))
    text += ("\n" + (f"{two_d} of rank 0's {len(placements)} parameters are 2-D DTensors on (dp, tp): sharded by "
                     "tensor parallelism, then again by FSDP" if tp > 1 else "one tp rank: FSDP's sharding alone"))
    return Layout(min(held), max(held), total, whole, two_d, len(placements), text)


# ============================================================================ against one process
@dataclass(frozen=True)
class Agreement:
    worst_loss: float
    worst_param: float
    within: bool
    text: str


def agreement(runs: dict[int, dict], loss_rtol: float, param_atol: float) -> Agreement:
    """The composed run against one process on every rank: within both tolerances, or not."""
    loss = max(r["max_loss_rel_diff"] for r in runs.values())
    param = max(r["max_param_diff"] for r in runs.values())
    ok = loss <= loss_rtol and param <= param_atol
    steps = len(runs[min(runs)]["reference_losses"])
    return Agreement(loss, param, ok, (
        f"over {steps} steps, on every rank: max relative loss difference {loss:.1e} (tolerance {loss_rtol:g}), "
        f"max |parameter difference| {param:.1e} (tolerance {param_atol:g}): "
        + ("the composed run trains as one process does" if ok else "NOT within the tolerances")))


@dataclass(frozen=True)
class HeldOut:
    first: float
    last: float
    fell: bool
    text: str


def held_out(curve: list, steps: int) -> HeldOut:
    """The held-out loss from the run's first evaluation to its last: fell, or did not."""
    first, last = curve[0][1], curve[-1][1]
    return HeldOut(first, last, last < first, f"held-out loss {first:.3f} -> {last:.3f} nats per byte over {steps} "
                   f"steps " + ("(it fell)" if last < first else "(it did NOT fall on this run)"))


# ========================================================================================= memory
@dataclass(frozen=True)
class Materialise:
    peak: int
    held: int
    whole: int
    never_whole: bool
    text: str


def materialise(runs: dict[int, dict]) -> Materialise:
    """The materialisation's peak on every rank against the whole model's bytes."""
    peak = max(r["materialise"]["peak"] for r in runs.values())
    held = max(r["materialise"]["held"] for r in runs.values())
    whole = runs[min(runs)]["model_bytes"]
    return Materialise(peak, held, whole, peak < whole, (
        f"materialising: at most {peak:,} bytes allocated on any rank ({peak / whole:.2f} of the whole model's "
        f"{whole:,}), {held:,} held after: "
        + ("no rank ever held the whole model" if peak < whole else "some rank held as much as the whole model")))


def held_rows(runs: dict[int, dict]) -> list[dict]:
    """One row per rank: what it holds after a step, its activations at the peak of 1F1B, and the
    peak allocated during a step (above the level before it), in KiB."""
    return [{"rank": rank, **r["coordinate"], **{f"{k} KiB": v / KiB for k, v in r["held"].items() if k != "total"},
             "activations KiB (peak)": r["activations"]["peak"] / KiB,
             "micro-batches in flight": r["activations"]["in_flight"], "peak during a step KiB": r["step_peak"] / KiB}
            for rank, r in runs.items()]


PARTS = ("parameters", "gradients", "optimizer state", "activations")


@dataclass(frozen=True)
class MemoryVsPlanner:
    rows: list[dict]
    states: tuple[float, float]                 # planner / measured, smallest and largest
    activations: dict[int, float]               # stage -> planner / measured
    text: str


def memory_vs_planner(runs: dict[int, dict], plan: dict, stages: int) -> MemoryVsPlanner:
    """Each stage's first rank, part by part, against the planner (lab12_plan.prediction's
    "memory": the first and the last stage), and what the activation ratio says."""
    planned = {0: plan["memory"]["first stage"], stages - 1: plan["memory"]["last stage"]}
    if stages == 1:
        planned = {0: plan["memory"]["last stage"]}        # one stage: embedding and output layer together
    rows = []
    for stage, rank in first_rank_of_each_stage(runs).items():
        if stage in planned:
            measured = {**runs[rank]["held"], "activations": runs[rank]["activations"]["peak"]}
            rows += [{"stage": stage, "rank": rank, "part": part, "measured KiB": measured[part] / KiB,
                      "planner KiB": planned[stage][part] / KiB, "planner / measured": planned[stage][part] / measured[part]}
                     for part in PARTS]
    states = [r["planner / measured"] for r in rows if r["part"] != "activations"]
    acts = {r["stage"]: r["planner / measured"] for r in rows if r["part"] == "activations"}
    text = (f"model states (parameters, gradients, AdamW): planner / measured {min(states):.3f} to {max(states):.3f}; "
            "activations " + ", ".join(f"stage {s}: {v:.2f}" for s, v in acts.items()) + "\n"
            + activation_ratio_text(acts))
    return MemoryVsPlanner(rows, (min(states), max(states)), acts, text)


def activation_ratio_text(ratios: dict[int, float], within: float = 0.05) -> str:
    """What the activations' planner / measured ratios say: below one (the planner leaves out
    what this model keeps besides Korthikanti et al.'s count), above one (it counts what this
    model does not keep), or within `within` of one."""
    below = [s for s, v in ratios.items() if v < 1 - within]
    above = [s for s, v in ratios.items() if v > 1 + within]
    parts = []
    if below:
        parts.append(f"stage(s) {below}: the planner counts less than was kept, so this model keeps something "
                     "Korthikanti et al.'s count leaves out (rotary positions' rotated q and k; on the last stage "
                     "the logits and the loss's intermediates)")
    if above:
        parts.append(f"stage(s) {above}: the planner counts more than was kept, so its count includes something "
                     "this model does not keep (its 4h-wide MLP where the model's is narrower; tensors a fused "
                     "kernel does not save)")
    rest = [s for s in ratios if s not in below + above]
    if rest:
        parts.append(f"stage(s) {rest}: within {within:.0%} of the planner")
    return "; ".join(parts)


# ====================================================================================== the traffic
@dataclass(frozen=True)
class Traffic:
    rows: list[dict]
    most_calls: str
    most_bytes: str
    text: str


def traffic(runs: dict[int, dict]) -> Traffic:
    """One step's calls and bytes by mesh dimension on each stage's first rank (the traffic
    meter's summary), and the dimensions with the most calls and the most bytes."""
    kinds = sorted({kind for r in runs.values() for t in r["traffic"].values() for kind in t["calls"]})
    rows = [{"stage": stage, "rank": rank, "dimension": dim, "calls": sum(t["calls"].values()),
             **{kind: t["calls"].get(kind, 0) for kind in kinds}, "KiB sent": t["sent_bytes"] / KiB}
            for stage, rank in first_rank_of_each_stage(runs).items()
            for dim, t in sorted(runs[rank]["traffic"].items())]
    calls: dict[str, int] = {}
    sent: dict[str, float] = {}
    for r in rows:
        calls[r["dimension"]] = calls.get(r["dimension"], 0) + r["calls"]
        sent[r["dimension"]] = sent.get(r["dimension"], 0.0) + r["KiB sent"]
    most_calls, most_bytes = max(calls, key=calls.get), max(sent, key=sent.get)
    return Traffic(rows, most_calls, most_bytes, f"most calls: {most_calls} ({calls[most_calls]} on the ranks above); "
                   f"most bytes sent: {most_bytes} ({sent[most_bytes]:.0f} KiB)")


# ======================================================================================= clipping
@dataclass(frozen=True)
class ClipNorms:
    rows: list[dict]
    all_below: bool
    text: str


def clip_norms(clips: dict[int, dict], shards: str, one_stage: bool) -> ClipNorms:
    """Step 0's norm as each rank computes it (lab12_clipping) against one process's."""
    c0 = clips[min(clips)]
    truth = c0["one_process"]["norm"]
    rows = [{"rank": rank, **c["coordinate"], **c["norms"], "one process": truth,
             "its coefficient min(1, c/norm)": c["coefficients"][shards]} for rank, c in clips.items()]
    own = [c["norms"][shards] for c in clips.values()]
    stage = [c["norms"]["this stage"] for c in clips.values()]
    glob = [c["norms"]["global (clip_grad_norm_)"] for c in clips.values()]
    coefficients = [c["coefficients"][shards] for c in clips.values()]
    below = max(own) < truth
    text = (f"global norm on every rank: {min(glob):.6g} to {max(glob):.6g}; one process: {truth:.6g} (largest relative "
            f"difference {max(abs(g - truth) / truth for g in glob):.1e})\n"
            f"a rank's own shards give {min(own):.4g} to {max(own):.4g}: "
            + ("every one of them below the true norm, and they differ from rank to rank" if below else
               "not all below the true norm on this run")
            + f"; a stage's norm gives {min(stage):.4g} to {max(stage):.4g}" + (" (one stage: the whole model)" if one_stage else "")
            + f"\nso each rank would scale its gradients by {min(coefficients):.3f} to {max(coefficients):.3f} instead of "
            f"{c0['true_coefficient']:.3f}")
    return ClipNorms(rows, below, text)


@dataclass(frozen=True)
class ClipRuns:
    right: float
    wrong: float
    spread: float
    text: str


def clip_runs(clips: dict[int, dict], own: str, tp: int) -> ClipRuns:
    """The AdamW steps clipped with the global norm and with each rank's own, against one process."""
    right = max(c["runs"]["global norm"]["max_param_diff"] for c in clips.values())
    wrong = max(c["runs"][own]["max_param_diff"] for c in clips.values())
    spread = max(c["runs"][own]["tp_replica_spread"] for c in clips.values())
    text = (f"clipping with each rank's own norm moved the parameters {wrong / max(right, 1e-12):.0f}x farther from one "
            f"process than the global norm did ({wrong:.1e} against {right:.1e})"
            + (f", and the tp ranks' copies of the same norm weights now differ by {spread:.1e}: replicas that silently "
               "diverge" if spread > 0 else (", and with one tp rank there are no copies to diverge" if tp == 1 else
                                             ", though the tp copies happen to agree on this run")))
    return ClipRuns(right, wrong, spread, text)


# ==================================================================================== checkpoints
@dataclass(frozen=True)
class Checkpoint:
    once: bool
    text: str


def checkpoint(ck: dict[int, dict], nproc: int) -> Checkpoint:
    """What is on disk: one file per rank and the metadata, each piece written once or not."""
    c0 = ck[min(ck)]["checkpoint"]
    full, payload = c0["full_state"], c0["payload"]
    per_rank = [r["checkpoint"]["my_file_bytes"] for r in ck.values()]
    once = sum(payload.values()) == full["total"]
    return Checkpoint(once, (
        f"one file per rank ({len(c0['files']) - 1} for {nproc} ranks) and the metadata; a rank writes {min(per_rank):,} to "
        f"{max(per_rank):,} bytes, of which tensor data {min(payload.values()):,} to {max(payload.values()):,}\n"
        f"a rank-0 full state_dict: rank 0 would hold and receive {full['total']:,} bytes (model {full['model']:,}, AdamW "
        f"{full['optimizer']:,}), {full['total'] / max(payload.values()):.1f}x the most any rank wrote here; the files' "
        f"tensor data add up to {sum(payload.values()):,}: "
        + ("every piece written exactly once" if once else "NOT the whole state once")))


@dataclass(frozen=True)
class Restart:
    rows: list[dict]
    restarted: bool
    same_losses: bool
    worst: float
    text: str


def restart(r0: dict, rep: dict, loss_rtol: float) -> Restart:
    """The killed-and-restarted run against the uninterrupted one: rank 0's report `r0` of
    lab12_resume and its "checkpoint" record `rep`."""
    first = dict(map(tuple, r0.get("attempt0_losses", [])))
    second = dict(map(tuple, r0.get("attempt1_losses", [])))
    reference = rep["uninterrupted"]
    rows = [{"step": s, "attempt 0": first.get(s, "-"), "attempt 1 (restarted)": second.get(s, "-"),
             "uninterrupted (one process)": reference[s],
             "relative difference": abs(second.get(s, first.get(s)) - reference[s]) / reference[s]}
            for s in range(len(reference))]
    worst = max(r["relative difference"] for r in rows)
    if rep["attempt"] != 1:
        return Restart(rows, False, False, worst, "no restart happened on this run (attempt 0 finished): see the "
                       "launch's output above")
    redone = sorted(set(first) & set(second))
    same = all(first[s] == second[s] for s in redone)
    return Restart(rows, True, same, worst, (
        f"torchrun restarted the group; attempt 1 resumed from step {rep['resumed_from']} (the last complete checkpoint), "
        f"recomputed steps {redone} " + ("with exactly the same losses" if same else "with DIFFERENT losses")
        + f"; every loss is within {worst:.1e} of the uninterrupted run (tolerance {loss_rtol:g})"
        + ("" if worst <= loss_rtol else ": NOT within the tolerance")))


@dataclass(frozen=True)
class Reshard:
    rows: list[dict]
    same: bool
    text: str


def reshard(rep: dict, loss_rtol: float) -> Reshard:
    """The checkpoint reloaded on other layouts and in one process: the next steps' losses."""
    r = rep["reshard"]
    rows = [{"loaded into": f"{' x '.join(map(str, rep['shape']))} (the layout that saved it)", "next losses": r["expected"]}]
    rows += [{"loaded into": f"{layout} (pp x dp x tp)", "next losses": losses} for layout, losses in r["layouts"].items()]
    rows.append({"loaded into": "one process (rank 0, no process group)", "next losses": r["one process"]})
    rows = [{**row, "next losses": ", ".join(f"{v:.7f}" for v in row["next losses"])} for row in rows]
    same = r["max_rel_diff"] <= loss_rtol
    return Reshard(rows, same, f"largest relative difference from the run that wrote it: {r['max_rel_diff']:.1e} "
                   f"(tolerance {loss_rtol:g}): " + ("the same next-step losses on every layout" if same else "NOT the same"))


@dataclass(frozen=True)
class MemoryStudy:
    pipelined: object                  # lab12_memory.WholeUnitsVerdict with a pipeline
    no_pipeline: object                # ... and without one
    reshard: object                    # lab12_memory.ReshardVerdict
    rows: list[dict] = field(default_factory=list)


def memory_study(study: dict) -> MemoryStudy:
    """labs/lab12_memory.py's run on one rank: the rows of its three steps and its verdicts."""
    from labs.lab12_memory import StepMemory, reshard_verdict, whole_units_verdict

    piped, plain = study["pipelined"], study["no pipeline"]
    steps = {f"{tuple(piped['shape'])}, reshard_after_forward=True (FSDP2's default)": StepMemory(**piped["default"]),
             f"{tuple(piped['shape'])}, reshard_after_forward=False (torchtitan under pp)":
                 StepMemory(**piped["reshard_after_forward=False"]),
             f"{tuple(plain['shape'])}, no pipeline, FSDP2's default": StepMemory(**plain["default"])}
    rows = [{"(pp, dp, tp), setting": name, "peak during the step KiB": m.peak_bytes / KiB,
             "most FSDP units whole at once": f"{m.most_whole_units} of {m.units}", "dp all-gathers": m.all_gathers,
             "dp reduce-scatters": m.reduce_scatters} for name, m in steps.items()]
    resharded, kept, alone = steps.values()
    return MemoryStudy(whole_units_verdict(resharded), whole_units_verdict(alone), reshard_verdict(resharded, kept), rows)
