"""Lab 13 (balancing the experts): DeepSeek-V3's bias beside the Switch loss, in one process.

Run:  ./run.sh labs/lab13_balance.py      (one process)

- `bias_chooses_only`: the router's bias (labs/lab13_model.py's `Router`) must change which
  experts a token goes to and nothing else: the gates are the chosen experts' affinities,
  normalised, whatever the bias. The function checks a router on tokens with a bias that moves
  some choices; a router that lets the bias into the gates fails it (`BiasInGates`, the test's
  opposite case). Why it matters (DeepSeek-AI 2024, arXiv:2412.19437, sec. 2.1.2): a bias in the
  gates would change the model's output to balance the load, the interference with the task that
  an auxiliary loss has and the bias is meant to avoid.
- `balance_study`: the same model trained three ways on the same batches: no balancing, the
  Switch loss (coefficient 0.01, Fedus et al.), the bias (DeepSeek-V3's rule at the config's rate,
  0.01: ten times the paper's, to act within this run's few steps); each step's load imbalance (max /
  mean assignments per expert, 1.0 when even) and loss. `balance_verdict` compares each with no
  balancing over the last third of the steps, step by step (the batches are the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helpers import runs
from labs.lab13_model import (MoEConfig, Router, check_model, default_config, imbalance, split, corpus,
                              train_reference)


@dataclass(frozen=True)
class Run(runs.Run):
    """The model (lab13_model.MODELS) and the steps each balancing trains, in one process."""
    model: str = "full"
    steps: int = 36
    ranks: int | None = 1
    SMOKE = dict(model="smoke", steps=6)
    TOUR = dict(model="smoke", steps=3)      # ./run.sh: a glimpse (every lab in minutes)

    def __post_init__(self):
        check_model(self.model)


VARIANTS = {"none": {"bias_rate": 0.0, "aux_coef": 0.0},
            "Switch loss": {"bias_rate": 0.0, "aux_coef": 0.01},
            "bias (DeepSeek-V3)": {"aux_coef": 0.0}}        # the config's rate


class BiasInGates(Router):
    """The mistake to catch: the bias added to the affinities before the gates are taken."""

    def forward(self, x, gate_weight=None):
        scores = torch.sigmoid(F.linear(x, self.gate.weight)) + self.bias
        top, experts = scores.topk(self.top_k, dim=-1)
        counts = F.one_hot(experts, self.num_experts).sum((0, 1))
        return experts, top / top.sum(-1, keepdim=True), counts, scores / scores.sum(-1, keepdim=True)


def bias_chooses_only(router: Router, tokens: int = 64, seed: int = 0) -> dict:
    """Route tokens without and with a bias towards expert 0: how many tokens changed their
    choice, and whether every token's gates equal its chosen experts' affinities normalised
    (computed here from the router's own weight, without the bias)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, router.gate.in_features, generator=g)
    with torch.no_grad():
        saved = router.bias.clone()
        router.bias.zero_()
        before, _, _, _ = router(x)
        router.bias[0] = 0.5
        after, gates, _, _ = router(x)
        router.bias.copy_(saved)
        scores = torch.sigmoid(F.linear(x, router.gate.weight)).gather(1, after)
        expected = scores / scores.sum(-1, keepdim=True)
    moved = int((before.sort(-1).values != after.sort(-1).values).any(-1).sum())
    return {"moved": moved, "gates_unbiased": bool(torch.allclose(gates, expected, atol=1e-6)),
            "max_gate_diff": (gates - expected).abs().max().item()}


def balance_study(config: MoEConfig, steps: int) -> dict[str, dict]:
    """Each of VARIANTS trained from the same weights on the same batches: per step the mean
    over MoE layers of the load imbalance (before that step's bias move) and the loss."""
    from helpers.bench import intra_op_threads

    data, _ = split(corpus())
    out = {}
    for name, changes in VARIANTS.items():
        # one thread, as the launch's ranks run: this model's operators are small, and on a shared
        # machine a second thread's spinning cost 20x here (measured: 0.08 s a step against 1.4-2.4)
        with intra_op_threads(1):
            run = train_reference(MoEConfig(**{**config.as_dict(), **changes}), steps, data)
        per_step = [sum(imbalance(v) for v in loads.values()) / len(loads) for loads in run["loads"]]
        out[name] = {"imbalance": per_step, "losses": run["losses"], **changes}
    return out


def balance_verdict(study: dict[str, dict], window: float = 1 / 3) -> dict[str, dict]:
    """Each balancing against none over the last `window` of the steps: the fraction of those
    steps where its imbalance was lower, its mean imbalance and loss there, and "lower" (lower in
    at least 80% of the steps), "higher" (higher in at least 80%) or "no clear difference" (ties,
    e.g. a run too short for the bias to act, count for neither)."""
    none = study["none"]
    n = len(none["imbalance"])
    start = n - max(1, int(n * window))
    out = {}
    for name, run in study.items():
        if name == "none":
            continue
        pairs = list(zip(run["imbalance"][start:], none["imbalance"][start:]))
        lower = sum(a < b for a, b in pairs) / len(pairs)
        higher = sum(a > b for a, b in pairs) / len(pairs)
        mean = sum(a for a, _ in pairs) / len(pairs)
        out[name] = {"lower_fraction": lower, "imbalance": mean,
                     "none_imbalance": sum(b for _, b in pairs) / len(pairs),
                     "loss": sum(run["losses"][start:]) / len(pairs), "none_loss": sum(none["losses"][start:]) / len(pairs),
                     "outcome": "lower" if lower >= 0.8 else "higher" if higher >= 0.8 else "no clear difference"}
    return out


def balance_sentence(verdict: dict) -> str:
    """`balance_verdict` in words."""
    parts = []
    for name, v in verdict.items():
        parts.append(f"{name}: imbalance {v['imbalance']:.2f} against {v['none_imbalance']:.2f} without balancing, "
                     f"lower in {v['lower_fraction']:.0%} of the steps ({v['outcome']}), loss {v['loss']:.3f} against "
                     f"{v['none_loss']:.3f}")
    return "; ".join(parts)


def run(ctx, cfg: Run) -> dict:
    """Both studies on rank 0 (the other ranks, if any, return {})."""
    if ctx.rank != 0:
        return {}
    config = default_config(cfg.model)
    return {"bias_chooses_only": {kind.__name__: bias_chooses_only(kind(config)) for kind in (Router, BiasInGates)},
            "verdict": balance_verdict(balance_study(config, cfg.steps))}


def main(argv: list[str] | None = None) -> None:
    from helpers.dist import distributed
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if not out:
            return
        ctx.report(**out)
        table([{"router": k, **v} for k, v in out["bias_chooses_only"].items()],
              title="a bias towards expert 0: tokens that moved, and whether the gates stayed unbiased")
        table([{"balancing": k, **v} for k, v in out["verdict"].items()],
              title="against no balancing, last third of the steps")
        print(balance_sentence(out["verdict"]), flush=True)


if __name__ == "__main__":
    main()
