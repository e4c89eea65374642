"""Lab 09 (at scale): the planner where no laptop goes. Configurations of a 7B and a 70B model
ranked on 64 to 1024 H100s, Megatron-LM's published runs beside the planner's predictions, where
each parallelism's bytes go, and the logic of the notebook's explorer.

Run:  ./run.sh 09      (this file alone: ./run.sh labs/lab09_at_scale.py; pure arithmetic, rank 0
                        prints; every table needs the planner exercise of labs/lab09_planner.py)

Hardware figures are the vendors' (NVIDIA H100 datasheet: 989 TFLOP/s dense bf16 on the SXM part,
80 GB HBM3, NVLink 900 GB/s in both directions; InfiniBand NDR 400 Gb/s per GPU), the runs are
Narayanan et al. 2021 (arXiv:2104.04473), table 1, typed in with their citation and labelled as
published: they are references, not measurements of this course. The planner's own assumptions
(latency per ring step, the fraction of peak its matmuls reach) are marked as such.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, replace

from helpers.comm_bench import LINK_BYTES_PER_S
from helpers.notice import attempt
from labs.lab09_planner import (A100_SELENE, GB, ClusterSpec, ModelSpec, ParallelConfig, axis_link,
                                check_config, narayanan_flops, plan_memory, plan_step_time)
from labs.lab09_schedules import pipeline_timing

# ================================================================= published hardware and runs
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense bf16, 80 GB HBM3, NVLink 900 GB/s
# (both directions: 450 GB/s each way); InfiniBand NDR 400 Gb/s = 50 GB/s per GPU (one NIC each).
# Latencies per ring step and the matmul efficiency are ASSUMPTIONS of this planner, not data.
H100_CLUSTER = ClusterSpec(
    "H100 SXM, 8 per node, NVLink + 400 Gb/s InfiniBand", gpus_per_node=8, memory_bytes=80 * GB,
    peak_flops=989e12, matmul_efficiency=0.7,
    intra_latency_s=1e-6, intra_bytes_per_s=LINK_BYTES_PER_S["NVLink 4.0, H100 (900 GB/s both ways)"],
    inter_latency_s=5e-6, inter_bytes_per_s=LINK_BYTES_PER_S["InfiniBand NDR 400 Gb/s (one NIC per GPU)"])

# PUBLISHED (not measured here): Narayanan et al. 2021, arXiv:2104.04473, table 1. GPT models with
# vocabulary 51,200 and sequence length 2048, mixed precision on A100s; per-GPU teraFLOP/s counted
# with eq. 3 (recomputation included). Columns: billions of parameters, heads, hidden, layers,
# tensor-parallel size, pipeline-parallel size, GPUs, batch size, teraFLOP/s per GPU, % of peak.
NARAYANAN_2021_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]

# GPT-layout models with Llama 2's depth, width, heads, vocabulary and 4096-token sequences
# (Touvron et al. 2023, arXiv:2307.09288), but an MLP of 4h and full multi-head attention (the
# layout the formulas assume); 1024 sequences = 4M tokens per step.
GPT_7B = ModelSpec("7B-class GPT (L 32, h 4096)", layers=32, hidden=4096, heads=32, seq=4096,
                   vocab=32000, global_batch=1024)
GPT_70B = ModelSpec("70B-class GPT (L 80, h 8192)", layers=80, hidden=8192, heads=64, seq=4096,
                    vocab=32000, global_batch=1024)


def mfu(model: ModelSpec, cluster: ClusterSpec, gpus: int, step_seconds: float) -> float:
    """Model FLOPs utilisation: model FLOPs (no recomputation) / (GPUs x peak x step time)."""
    return narayanan_flops(model, recompute=False) / (gpus * cluster.peak_flops * step_seconds)


def published_chunks(layers_per_stage: int) -> int:
    """Model chunks per rank (v) we give a row of table 1: the smallest v >= 2 that divides a
    stage's layers (Megatron-LM needs whole layers per chunk). The paper ran the interleaved
    schedule but does not print v: this is our assumption."""
    return next((v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0), 1)


def published_comparison(micro_batch: int = 1, cluster: ClusterSpec = A100_SELENE) -> list[dict]:
    """Each row of Narayanan et al.'s table 1 (published) beside the planner's prediction for that
    configuration, run as they ran it (sec. 5.1): their t, p, GPUs and batch, full recomputation,
    the interleaved schedule with the scatter/gather optimisation (the planner's pipeline messages
    are 1/t of an activation) where p > 1, ZeRO 0. The table gives neither the chunks per rank nor
    the micro-batch size: `published_chunks` and micro-batches of `micro_batch` sequences are our
    assumptions (columns v and b)."""
    rows = []
    for billions, heads, hidden, layers, t, p, gpus, batch, tflops, peak_pct in NARAYANAN_2021_TABLE1:
        model = ModelSpec(f"GPT {billions}B", layers, hidden, heads, 2048, 51200, batch)
        dp = gpus // (t * p)
        v = published_chunks(layers // p) if p > 1 else 1
        config = ParallelConfig(dp=dp, tp=t, pp=p, micro_batches=batch // (dp * micro_batch),
                                recompute="full", sequence_parallel=False,
                                schedule="interleaved 1F1B" if v > 1 else "1F1B", virtual_stages=v)
        plan = plan_step_time(model, cluster, config)
        predicted = narayanan_flops(model) / gpus / plan.total / 1e12
        rows.append({"model": model.name, "t": t, "p": p, "d": dp, "v": v if p > 1 else "-", "b": micro_batch,
                     "GPUs": gpus, "batch": batch,
                     "published TFLOP/s/GPU": tflops, "predicted TFLOP/s/GPU": predicted,
                     "predicted / published": predicted / tflops,
                     "bubble %": 100 * plan.bubble / plan.total,
                     "comm %": 100 * (plan.tp_comm + plan.pp_comm + plan.dp_comm) / plan.total,
                     "efficiency that matches": cluster.matmul_efficiency * tflops / predicted})
    return rows


# ==================================================================================== ranking
def candidate_configs(model: ModelSpec, gpus: int, micro_batch: int = 1, tps=(1, 2, 4, 8),
                      pps=(1, 2, 4, 8), zero_stages=(1,), recomputes=("selective",),
                      schedules=("1F1B", "interleaved 1F1B")) -> list[ParallelConfig]:
    """Every configuration of `gpus` GPUs that splits evenly: tensor parallel inside a node,
    sequence parallelism whenever tp > 1, interleaving with v = 2, ZeRO-1 and selective
    recomputation (Megatron-LM's defaults) unless asked otherwise."""
    out = []
    for tp, pp, zero, recompute, schedule in itertools.product(tps, pps, zero_stages, recomputes, schedules):
        if gpus % (tp * pp) or (pp == 1 and schedule != "1F1B"):
            continue
        dp = gpus // (tp * pp)
        if model.global_batch % (dp * micro_batch):
            continue
        config = ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=zero,
                                micro_batches=model.global_batch // (dp * micro_batch),
                                recompute=recompute, sequence_parallel=tp > 1, schedule=schedule,
                                virtual_stages=2 if schedule == "interleaved 1F1B" else 1)
        try:
            check_config(model, config=config)
        except ValueError:
            continue
        out.append(config)
    return out


def rank_configs(model: ModelSpec, cluster: ClusterSpec, gpus: int, top: int = 5, **options) -> list[dict]:
    """The `top` fastest configurations that fit in memory, as table rows (and how many fit)."""
    rows = []
    for config in candidate_configs(model, gpus, **options):
        memory = plan_memory(model, config)
        if memory.total > cluster.memory_bytes:
            continue
        time = plan_step_time(model, cluster, config)
        rows.append({"GPUs": gpus, "dp": config.dp, "tp": config.tp, "pp": config.pp,
                     "schedule": config.schedule if config.pp > 1 else "-",
                     "recompute": config.recompute, "GB/GPU": memory.total / GB,
                     "step s": time.total, "MFU": mfu(model, cluster, gpus, time.total),
                     "bubble %": 100 * time.bubble / time.total,
                     "comm %": 100 * (time.tp_comm + time.pp_comm + time.dp_comm) / time.total})
    rows.sort(key=lambda r: r["step s"])
    return rows[:top]


# ================================================================================= the explorer
MODELS = {"7B": GPT_7B, "70B": GPT_70B}


def explore(model_name: str, gpus: int, tp: int, pp: int, zero_stage: int, recompute: str,
            schedule: str, micro_batch: int = 1, cluster: ClusterSpec = H100_CLUSTER) -> dict:
    """What the notebook's explorer shows for one configuration of MODELS[model_name]: {"error":
    why it does not split, or None; "config"; what needs no exercise: "model" (its shape, batch
    and parameters), "links" (`axis_links`) and "schedule" (the simulated bubble / ideal time
    with t_B = 2 t_F and free messages, and the micro-batches stage 0 holds); then the planner's
    "memory" rows (GB, from `plan_memory`), "time" rows (seconds, from `plan_step_time`) and,
    with both, "summary" (fits, step time, MFU, tokens/s); while either exercise is still a stub
    (student edition), "unsolved": the stubs' messages, one per exercise}. Interleaving uses
    v = 2; sequence parallelism when tp > 1."""
    model = MODELS[model_name]
    if gpus % (tp * pp):
        return {"error": f"{gpus} GPUs are not a multiple of tp x pp = {tp * pp}"}
    dp = gpus // (tp * pp)
    if model.global_batch % (dp * micro_batch):
        return {"error": f"the batch of {model.global_batch} sequences does not split over {dp} "
                         f"replicas x micro-batches of {micro_batch}"}
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage,
                            micro_batches=model.global_batch // (dp * micro_batch), recompute=recompute,
                            sequence_parallel=tp > 1, schedule=schedule if pp > 1 else "1F1B",
                            virtual_stages=2 if schedule == "interleaved 1F1B" and pp > 1 else 1)
    try:
        check_config(model, config)
    except ValueError as exc:
        return {"error": str(exc)}
    timing = {"bubble_ratio": 0.0, "peak_held": 1.0}
    if pp > 1:
        timing = pipeline_timing(config.schedule, pp, config.micro_batches, 1.0, 2.0, config.virtual_stages)
    out = {"error": None, "config": asdict(config), "links": axis_links(cluster, config),
           "model": {"name": model.name, "layers": model.layers, "hidden": model.hidden, "heads": model.heads,
                     "seq": model.seq, "global batch": model.global_batch, "parameters": model.params},
           "schedule": {"bubble / ideal": timing["bubble_ratio"], "held on stage 0": timing["peak_held"]}}
    # each exercise on its own: one solved shows its part, and each stub its own notice
    memory = attempt(plan_memory, model, config)
    time = attempt(plan_step_time, model, cluster, config)
    unsolved = [p["unsolved"] for p in (memory, time) if isinstance(p, dict)]
    if unsolved:
        out["unsolved"] = list(dict.fromkeys(unsolved))  # plan_step_time may stop on plan_memory's
    if not isinstance(memory, dict):
        out["memory"] = {"parameters": memory.parameters / GB, "gradients": memory.gradients / GB,
                         "optimizer state": memory.optimizer_state / GB, "activations": memory.activations / GB}
    if not isinstance(time, dict):
        out["time"] = {"compute": time.compute, "tensor parallel": time.tp_comm, "pipeline messages": time.pp_comm,
                       "bubble": time.bubble, "data parallel": time.dp_comm}
    if not unsolved:
        out["summary"] = {"fits": memory.total <= cluster.memory_bytes, "GB per GPU": memory.total / GB,
                          "step s": time.total, "MFU": mfu(model, cluster, gpus, time.total),
                          "tokens/s": model.global_batch * model.seq / time.total}
    return out


AXES = (("tensor", "tp"), ("pipeline", "pp"), ("data", "dp"))


def axis_links(cluster: ClusterSpec, config: ParallelConfig) -> list[dict]:
    """Per axis: its group size, the link its group crosses (`axis_link`: ranks laid out tp
    fastest, then dp, then pp) and that link's bandwidth per direction and latency per ring step
    (one hop of a collective's ring: an all-reduce on n GPUs takes 2(n-1) of them)."""
    rows = []
    for axis, key in AXES:
        link = axis_link(cluster, config, key)
        inside = (link.latency_s, link.bytes_per_s) == (cluster.intra_latency_s, cluster.intra_bytes_per_s)
        rows.append({"axis": axis, "group size": getattr(config, key),
                     "link": "inside a node" if inside else "between nodes",
                     "GB/s of that link": link.bytes_per_s / GB,
                     "latency per ring step, us": link.latency_s * 1e6})
    return rows


def axis_rows(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> list[dict]:
    """Where each parallelism goes: per axis, the link its group crosses, the bytes one GPU sends
    per step and the seconds they take there, from the planner."""
    time = plan_step_time(model, cluster, config)
    sent = {"tensor": (time.tp_bytes, time.tp_comm), "pipeline": (time.pp_bytes, time.pp_comm),
            "data": (time.dp_bytes, time.dp_comm)}
    return [{"axis": row["axis"], "group size": row["group size"], "link": row["link"],
             "GB sent per GPU per step": sent[row["axis"]][0] / GB, "exposed s": sent[row["axis"]][1],
             "GB/s of that link": row["GB/s of that link"]}
            for row in axis_links(cluster, config)]


def with_tp_across_nodes(config: ParallelConfig, cluster: ClusterSpec) -> ClusterSpec:
    """The same cluster with nodes too small for the tp group (what if TP crossed InfiniBand)."""
    return replace(cluster, gpus_per_node=max(1, config.tp // 2))


def main() -> None:
    from helpers.dist import distributed
    from helpers.notice import notice_if_unsolved, solved
    from helpers.show import table

    with distributed() as ctx:
        if ctx.rank != 0:        # pure arithmetic: one rank is enough
            return
        ranked = {f"{name} on {n} GPUs": attempt(rank_configs, model, H100_CLUSTER, n, top=3)
                  for name, model in MODELS.items() for n in (64, 1024)}
        published = attempt(published_comparison)
        ctx.report(ranked=ranked, published=published)
        for title, rows in ranked.items():
            with notice_if_unsolved():
                table(solved(rows), title=f"{title} ({H100_CLUSTER.name}): fastest that fit", floatfmt=".3g")
        with notice_if_unsolved():
            table(solved(published), title="Narayanan et al. 2021 table 1 (published) vs planner", floatfmt=".3g")

if __name__ == "__main__":
    main()
