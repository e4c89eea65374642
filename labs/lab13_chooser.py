"""Lab 13 (the layout chooser): the planner (labs/lab13_planner.py) ranks every 5-D layout of the
ranks for this machine, measured in the launch (`measure_machine`, `this_machine`); the top two
are built and stepped alternately (`chooser`, part of labs/lab13_studies.py's launch) and
`ranking_verdict` says whether the predicted order held, was reversed, or the rounds disagree
(noise). The same planner ranks DeepSeek-V3's layouts on its published cluster
(`published_ranking`), with the published layout's place among them.

Run:  ./run.sh labs/lab13_chooser.py      (pure arithmetic on rank 0: both rankings, with this
                                           machine assumed, not measured)
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from helpers import runs
from helpers.dist import DistContext
from labs.lab09_planner import ClusterSpec
from labs.lab13_model import check_model, corpus, default_config, split
from labs.lab13_planner import Layout, MoEShape, rank_layouts
from labs.lab13_train import Trainer


@dataclass(frozen=True)
class Run(runs.Run):
    """The model whose layouts are ranked (lab13_model.MODELS) and the ranks they are for."""
    model: str = "full"
    layout_ranks: int = 8
    ranks: int | None = 1
    SMOKE = dict(model="smoke")

    def __post_init__(self):
        check_model(self.model)


# ================================================================================== the verdict
def ranking_verdict(predicted: list[str], measured: dict[str, list[float]]) -> dict:
    """Did the predicted order of two layouts hold? `predicted`: the two layouts' names, best
    first; `measured[name]`: their step times, round by round (run alternately, so round i of each
    saw the same load). "held" if the first was faster in every round, "reversed" if slower in
    every round, "noise" if the rounds disagree."""
    a, b = predicted
    ratios = [x / y for x, y in zip(measured[a], measured[b])]      # < 1: the first was faster
    outcome = "held" if max(ratios) < 1 else "reversed" if min(ratios) > 1 else "noise"
    return {"outcome": outcome, "ratios": ratios, "median_ratio": sorted(ratios)[len(ratios) // 2]}


def verdict_sentence(v: dict, predicted: list[str]) -> str:
    a, b = predicted
    share = f"{a} took {v['median_ratio']:.2f}x the time of {b} (median of {len(v['ratios'])} rounds)"
    return {"held": f"the ranking held: {share}, faster in every round",
            "reversed": f"the ranking did not hold: {share}, slower in every round",
            "noise": f"no verdict beyond noise: {share}, but the rounds disagree"}[v["outcome"]]


# ============================================================================ the machines
def this_machine(measured: dict, ranks: int) -> ClusterSpec:
    """This machine as the planner sees it, from `measure_machine`'s numbers: every rank on one
    node, the fixed cost of a call, the bus bandwidth, the rate of a rank's matmuls with every rank
    busy; memory: the machine's RAM over the ranks (an assumption: 24 GiB unless measured)."""
    return ClusterSpec("this machine", gpus_per_node=ranks, memory_bytes=measured.get("memory_bytes", 24 * 2**30) / ranks,
                       peak_flops=measured["flops_per_s"], matmul_efficiency=1.0, intra_latency_s=0.0,
                       intra_bytes_per_s=measured["bytes_per_s"], inter_latency_s=0.0,
                       inter_bytes_per_s=measured["bytes_per_s"], call_s=measured["call_s"])


def measure_machine(ctx, config, repeats: int = 3) -> dict:
    """Measured with every rank at once: the median time of a 4-byte all-reduce (a call's fixed
    cost), the bus bandwidth of a 4 MiB all-reduce beyond it, and the model FLOPs per second a
    rank reaches training the whole model (one process, lab 13's layers) on its share of a
    batch's tokens: the rate of this model's operators at this size on this machine, with every
    rank busy, not a large matmul's."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from labs.lab13_model import MoEConfig, build_model, model_loss

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            ctx.barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    small, big = torch.zeros(1, device=ctx.device), torch.zeros(2**20, device=ctx.device)
    call_s = timed(lambda: dist.all_reduce(small))
    big_s = timed(lambda: dist.all_reduce(big))
    n = ctx.world_size
    bytes_per_s = 2 * (n - 1) / n * big.nbytes / max(big_s - call_s, 1e-6) if n > 1 else float("inf")
    rows = max(1, config.batch // n)
    share = MoEConfig(**{**config.as_dict(), "batch": rows})
    model = build_model(share, ctx.device)
    x = torch.randint(0, config.vocab, (rows, config.seq), device=ctx.device)

    def step():
        model_loss(model, model(x), x).backward()
    seconds = timed(step)
    flops = MoEShape.from_config(share).flops_per_token() * rows * config.seq
    return {"call_s": call_s, "bytes_per_s": bytes_per_s, "flops_per_s": flops / seconds}


# DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; the released config): 61 layers, the first 3
# dense (MLP 18,432), width 7168, 128 heads (multi-head latent attention; counted here as
# attention with 128 kv heads), 256 routed experts of width 2048, 8 per token, one shared expert;
# vocabulary 129,280; 4K-token sequences, a batch of 15,360 sequences at the end of pre-training.
# Trained on 2048 H800s: pp 16, ep 64 over 8 nodes, ZeRO-1 data parallelism (sec. 3.2): in this
# planner's terms, pp 16 x dp_replicate 2 x dp_shard 64 (ep = dp_shard x cp = 64).
DEEPSEEK_V3 = MoEShape("DeepSeek-V3", layers=61, dense_layers=3, dim=7168, heads=128, kv_heads=128, ffn=18432,
                       experts=256, top_k=8, expert_ffn=2048, shared_ffn=2048, vocab=129280, seq=4096, batch=15360)
DEEPSEEK_V3_PUBLISHED = Layout(pp=16, dp_replicate=2, dp_shard=64)


def published_ranking(gpus: int = 2048) -> list[dict]:
    """DeepSeek-V3's layouts on 2048 H800s (labs/lab11_rankings.py's H800_CLUSTER), bf16 (2 bytes), tp at most 8
    (one node), one sequence a micro-batch, each layer's input kept and the rest recomputed (an
    ASSUMPTION: DeepSeek-V3 recomputes its norms and some projections and keeps activations in
    FP8), with the published layout's place among them. The first 3 of 61 layers do not
    split evenly over pp: the planner takes 64 layers (61 rounded up) for the split."""
    from labs.lab11_rankings import H800_CLUSTER

    shape = replace(DEEPSEEK_V3, layers=64, dense_layers=3)
    rows = rank_layouts(shape, H800_CLUSTER, gpus, element_bytes=2, max_tp=8, micro_batch_rows=1, recompute="full")
    for i, row in enumerate(rows):
        row["rank"] = i + 1
        row["published"] = row["sizes"] == DEEPSEEK_V3_PUBLISHED.sizes
    return rows


# ============================================================================ the chooser
def chooser(ctx: DistContext, rounds: int, config=None) -> dict:
    """This machine measured; every layout of the ranks ranked on it; the top two (whose traffic
    the planner counts) built and stepped alternately, `rounds` timed steps each after a warm-up;
    each round's time is its slowest rank's."""
    config = config or default_config()
    machine = measure_machine(ctx, config)
    ranking = rank_layouts(MoEShape.from_config(config), this_machine(machine, ctx.world_size), ctx.world_size)
    top = [r["sizes"] for r in ranking[:2]]
    data, _ = split(corpus())
    trainers = [Trainer(ctx, config, sizes) for sizes in top]
    times: list[list[float]] = [[], []]
    for step in range(rounds + 1):
        for i, trainer in enumerate(trainers):
            ctx.barrier()
            start = time.perf_counter()
            trainer.step(data, step)
            seconds = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if step:
                times[i].append(seconds.item())
    names = [r["layout"] for r in ranking[:2]]
    return {"machine": machine, "ranking": ranking, "top": names, "measured": dict(zip(names, times))}


def run(ctx, cfg: Run) -> dict:
    """Both rankings on rank 0 (the other ranks, if any, return {}): cfg's model on
    `layout_ranks` ranks of a machine ASSUMED here, and DeepSeek-V3's."""
    if ctx.rank != 0:
        return {}
    assumed = {"call_s": 1e-3, "bytes_per_s": 1e9, "flops_per_s": 5e9}
    rows = rank_layouts(MoEShape.from_config(default_config(cfg.model)), this_machine(assumed, cfg.layout_ranks),
                        cfg.layout_ranks)
    return {"assumed": assumed, "ranking": rows, "published": published_ranking()[:8],
            "top": [asdict(Layout(**r["sizes"])) for r in rows[:2]]}


def main(argv: list[str] | None = None) -> None:
    from helpers.dist import distributed
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if not out:
            return
        ctx.report(top=out["top"])
        table([{"layout": r["layout"], "step ms": 1e3 * r["step_s"], "calls": r["calls"], "fits": r["fits"]}
               for r in out["ranking"]], title=f"{cfg.layout_ranks} ranks on a machine ASSUMED here "
                                                "(1 ms a call, 1 GB/s, 5 GFLOP/s)")
        table([{k: r[k] for k in ("rank", "layout", "step_s", "fits", "published")} for r in out["published"]],
              title=f"{DEEPSEEK_V3.name} on 2048 H800s: the first layouts")


if __name__ == "__main__":
    main()
