"""Lab 11 (experts): a mixture-of-experts layer in one process, then its experts spread over ranks.

A library of lab 11 (no main): ./run.sh 11 runs the labs that use it, and
./run.sh labs/lab11_expert_check.py checks the layer against the dense one.

- `MoE(hidden, ffn, num_experts, top_k)`: a router (nn.Linear, no bias) scores every token, each
  token goes to its top-k experts (small MLPs), and their outputs are added weighted by the gates
  (Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
  Layer", arXiv:1701.06538). Gates: for k > 1 the top-k probabilities renormalised to sum to 1 (a
  softmax over the top-k logits: Mixtral, Jiang et al. 2024, arXiv:2401.04088; GShard's top-2,
  Lepikhin et al. 2020, arXiv:2006.16668); for k = 1 the router's probability itself (Switch
  Transformer, Fedus, Zoph and Shazeer 2021, arXiv:2101.03961: renormalised it would always be 1
  and the router would learn nothing from the task). The load-balancing loss E * sum_i f_i P_i
  (Switch, eq. 4; 1 when the router's probabilities are uniform, at most E/k) is kept in
  `aux_loss` after each forward; an optional capacity factor drops the assignments beyond
  ceil(factor * T k / E) per expert, first choices before second choices (GShard), and counts them
  (default: no capacity, nothing dropped: a dropless MoE).
- `ExpertParallelMoE.from_dense(moe, group)`: rank r of the group holds experts [r E/N, (r+1) E/N)
  and a copy of the router. Its `forward` is the homework: every rank routes its own tokens, the
  counts go first (all_to_all_single), then each token row travels to the rank that owns its
  expert (all_to_all_single with per-rank split sizes), the experts run, and a second all-to-all
  brings the results back to be combined with the gates in token order (GShard's dispatch and
  combine). `all_to_all` (given) is that collective as an autograd function.
- `routing_plan` (which token goes to which expert on which rank, the split sizes per rank pair:
  the explorer) and `all_to_all_bytes` (bytes per rank from the routing). The layer against the
  dense one, with the bytes counted at the process group, is labs/lab11_expert_check.py; the
  imbalance a skewed router causes, what the auxiliary loss does to it in training, and expert x
  data parallelism are labs/lab11_expert_balance.py.

Homework: `ExpertParallelMoE.forward` below. Check it with `./run.sh check 11`
(the public tests: tests/public/test_lab11_experts.py).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.tensors import divide, seeded

COUNT_DTYPE = torch.int64  # the token counts exchanged before the rows


# ============================================================================ routing
@dataclass
class Routing:
    """Where each of T tokens goes, for k choices each (E experts)."""
    experts: torch.Tensor     # (T, k) int64: the chosen experts, best first
    weights: torch.Tensor     # (T, k) the gates the combine multiplies by (differentiable)
    kept: torch.Tensor        # (T, k) bool: False where the expert was full (capacity) and dropped
    probs: torch.Tensor       # (T, E) the router's softmax (differentiable)
    aux_loss: torch.Tensor    # () the load-balancing loss E * sum_i f_i P_i

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """(E,) kept assignments per expert: the rows each expert runs on."""
        return torch.bincount(self.experts[self.kept], minlength=self.probs.shape[-1])

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert accepts: ceil(factor * T k / E), the even share times the factor
    (Switch's expert capacity, times k for top-k); None: no limit."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: which assignments an expert of `capacity` accepts. Every token's first choice
    queues before any second choice (GShard), tokens in order inside each round."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, top_k = experts.shape
    by_priority = experts.t().reshape(-1)                                      # (k T): round by round
    queue = F.one_hot(by_priority, num_experts).cumsum(0)                      # (k T, E) running counts
    place = queue.gather(1, by_priority.unsqueeze(1)).squeeze(1) - 1           # place in its expert's queue
    return (place < capacity).reshape(top_k, tokens).t()


def route(router: nn.Module, x: torch.Tensor, top_k: int, capacity_factor: float | None = None) -> Routing:
    """Route tokens x (T, hidden): softmax of the router's logits, top-k, gates, aux loss, capacity.

    aux_loss = E * sum_i f_i P_i (Switch Transformer eq. 4): f_i the fraction of the T k
    assignments that chose expert i (before any drop), P_i the mean router probability of expert i.
    It is 1 when the probabilities are uniform, and at most E/k: a token chooses k different
    experts, so f_i <= 1/k, and one expert with probability 1 on every token gives E (1/k) 1
    (Switch's k = 1: E). Its gradient reaches the router through P (f is a count). The
    coefficient (Switch: 1e-2) is the training loop's."""
    probs = router(x).softmax(dim=-1)                                           # (T, E)
    tokens, num_experts = probs.shape
    top_probs, experts = probs.topk(top_k, dim=-1)                              # (T, k) best first
    weights = top_probs / top_probs.sum(-1, keepdim=True) if top_k > 1 else top_probs
    chose = F.one_hot(experts, num_experts).sum(1).to(probs.dtype)              # (T, E) 0/1
    fraction = chose.sum(0) / max(tokens * top_k, 1)                            # f: sums to 1
    mean_prob = probs.sum(0) / max(tokens, 1)                                   # P: sums to 1
    aux_loss = num_experts * (fraction * mean_prob).sum()
    capacity = expert_capacity(tokens, top_k, num_experts, capacity_factor)
    return Routing(experts, weights, within_capacity(experts, num_experts, capacity), probs, aux_loss)


# ============================================================================ the one-process layer
class Expert(nn.Module):
    """One expert: a small MLP, hidden -> ffn -> hidden."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RoutedLayer(nn.Module):
    """What both layers share: the router, top_k, the capacity factor, and `route`, which records
    the last forward's aux loss, kept tokens per expert and dropped assignments."""

    router: nn.Linear
    top_k: int
    capacity_factor: float | None

    def route(self, x: torch.Tensor) -> Routing:
        """`route(self.router, x, ...)`; also sets self.aux_loss (differentiable),
        self.tokens_per_expert ((E,), kept assignments) and self.dropped."""
        routing = route(self.router, x, self.top_k, self.capacity_factor)
        self.aux_loss = routing.aux_loss
        self.tokens_per_expert = routing.tokens_per_expert.detach()
        self.dropped = routing.dropped
        return routing

    @property
    def num_experts(self) -> int:
        return self.router.out_features


class MoE(RoutedLayer):
    """Mixture of experts in one process: x (..., hidden) -> (..., hidden).

    out[t] = sum over t's kept choices c of weights[t, c] * experts[e_tc](x[t]); every expert runs
    once per forward, on exactly the tokens routed to it (none: it does not run)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.hidden, self.ffn, self.top_k, self.capacity_factor = hidden, ffn, top_k, capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])                                       # (T, hidden)
        routing = self.route(tokens)
        out = tokens.new_zeros(tokens.shape)
        for e, expert in enumerate(self.experts):
            token, choice = ((routing.experts == e) & routing.kept).nonzero(as_tuple=True)
            if len(token):                                                         # in token order
                gate = routing.weights[token, choice].unsqueeze(1)
                out = out.index_add(0, token, gate * expert(tokens[token]))
        return out.reshape(x.shape)


def make_moe(hidden: int, ffn: int, num_experts: int, top_k: int, capacity_factor: float | None = None,
             *, seed: int = 0, dtype=torch.float32, device="cpu") -> MoE:
    """The same MoE on every rank (seeded, built on the CPU, then moved)."""
    with seeded(seed):
        moe = MoE(hidden, ffn, num_experts, top_k, capacity_factor)
    return moe.to(device=device, dtype=dtype)


# ============================================================================ the all-to-all
class AllToAll(torch.autograd.Function):
    """all_to_all_single on rows, differentiable: rows input_splits[j] go to rank j of the group,
    rows output_splits[i] arrive from rank i, in rank order. Its backward sends the gradient rows
    back the way they came: the same all-to-all with the split sizes swapped (an all-to-all only
    moves rows between ranks, so its adjoint is its inverse). GShard's dispatch and combine are two
    of these (Lepikhin et al. 2020). (torch.distributed.nn.functional.all_to_all_single does the
    same, deprecated in torch 2.13.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """x (sum(input_splits), ...) -> (sum(output_splits), ...): the first input_splits[0] rows go to
    group rank 0, the next input_splits[1] to rank 1...; the result holds rank 0's rows for us,
    then rank 1's... Differentiable (AllToAll). Every rank of `group` must call it, with split
    sizes that agree: what rank i sends to rank j is what j expects from i."""
    return AllToAll.apply(x, list(output_splits), list(input_splits), group)


# ============================================================================ the expert-parallel layer
class ExpertParallelMoE(RoutedLayer):
    """The MoE with its experts spread over the ranks of `group` (N ranks, E experts, E/N each).

    Group rank r holds `experts` = copies of the dense layer's experts r E/N ... (r+1) E/N - 1 (an
    nn.ModuleList; `first_expert` = r E/N) and `router`, a copy of the dense router. Build it with
    `from_dense`."""

    def __init__(self, router: nn.Linear, experts: list[nn.Module], top_k: int,
                 capacity_factor: float | None = None, group=None):
        super().__init__()
        self.group = group
        self.ep_rank, self.ep_size = dist.get_rank(group), dist.get_world_size(group)
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.num_local = divide(router.out_features, self.ep_size, "experts over the expert-parallel ranks")
        if len(self.experts) != self.num_local:
            raise ValueError(f"group rank {self.ep_rank} holds {len(self.experts)} experts, "
                             f"expected {self.num_local}")
        self.first_expert = self.ep_rank * self.num_local

    @classmethod
    def from_dense(cls, moe: MoE, group=None) -> "ExpertParallelMoE":
        """This rank's share of `moe`: a copy of its router and of experts [r E/N, (r+1) E/N)."""
        n, r = dist.get_world_size(group), dist.get_rank(group)
        local = divide(moe.num_experts, n, "experts over the expert-parallel ranks")
        mine = [copy.deepcopy(moe.experts[e]) for e in range(r * local, (r + 1) * local)]
        return cls(copy.deepcopy(moe.router), mine, moe.top_k, moe.capacity_factor, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Exercise: the expert-parallel forward, this rank's tokens through every rank's experts.

        x (T, hidden): this rank's tokens (T may differ between ranks, 0 included). Returns
        (T, hidden) in x's token order: what the dense layer this one was built from returns on
        x, differentiable w.r.t. x, the router and the experts. Route with `routing =
        self.route(x)` (the dense layer's routing: same experts, gates and capacity drops; it also
        records self.aux_loss).

        Contract (what the tests check, on 1 to 4 ranks, sub-groups, top-1 to top-3, routings so
        uneven that one rank receives many more rows than another, dropped tokens, float32/64):
        - output and dL/dx equal the dense layer's on x; the router's gradient equals the dense
          router's from this rank's tokens; each local expert's gradient equals the dense expert's
          summed over the tokens of every rank in the group (the backward brings it home);
        - communication: all_to_all_single over `self.group` only, three per forward: the token
          counts (at most E integers per rank), the rows, the results; and two in the backward
          (`all_to_all` carries the gradients). One row per kept (token, expert) choice, each to
          the rank that owns that expert: rank r sends rank j exactly the rows of its tokens routed
          to j's experts (`all_to_all_bytes` gives the bytes), nothing for dropped choices;
        - each local expert (`self.experts[j]`, global expert `self.first_expert + j`) runs only on
          the rows routed to it, from every rank, in one call per forward (its pieces from every
          rank together: one large matmul, not N small ones; the tests count rows and calls with
          forward hooks).
        """
        ### BEGIN SOLUTION
        routing = self.route(x)
        tokens, k = routing.experts.shape
        choice_expert = routing.experts.reshape(-1)                                # (T k,) token-major
        choice_token = torch.arange(tokens, device=x.device).repeat_interleave(k)
        kept = routing.kept.reshape(-1).nonzero().squeeze(1)
        # Sorted by expert (stably): the rows for group rank j's experts form one block, expert by expert.
        order = kept[torch.argsort(choice_expert[kept], stable=True)]
        per_expert = torch.bincount(choice_expert[order], minlength=self.num_experts).to(COUNT_DTYPE)
        # The counts first: from_rank[i, j] = rows rank i will send to our local expert j.
        from_rank = torch.empty_like(per_expert)
        dist.all_to_all_single(from_rank, per_expert, group=self.group)
        from_rank = from_rank.view(self.ep_size, self.num_local)
        send_splits = per_expert.view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = from_rank.sum(1).tolist()
        rows = all_to_all(x[choice_token[order]], recv_splits, send_splits, self.group)  # dispatch
        # rows: rank 0's block (its rows for our expert 0, then expert 1...), then rank 1's block...
        pieces = list(rows.split(from_rank.reshape(-1).tolist()))
        for j, expert in enumerate(self.experts):
            mine = [i * self.num_local + j for i in range(self.ep_size)]      # every rank's rows for j
            results = expert(torch.cat([pieces[p] for p in mine]))
            for p, result in zip(mine, results.split([len(pieces[p]) for p in mine])):
                pieces[p] = result
        back = all_to_all(torch.cat(pieces), send_splits, recv_splits, self.group)  # combine: in `order`
        gated = back * routing.weights.reshape(-1)[order].unsqueeze(1)
        return x.new_zeros(x.shape).index_add(0, choice_token[order], gated)
        ### END SOLUTION

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local - 1} of "
                f"{self.num_experts}, top_k={self.top_k}, ep_rank={self.ep_rank}/{self.ep_size}")


# ============================================================================ routing, on paper
def sample_tokens(tokens: int, hidden: int, *, seed: int, shift: float = 0.0, dtype=torch.float32,
                  device="cpu") -> torch.Tensor:
    """(tokens, hidden) normal rows, plus `shift` along the all-ones direction (unit length): a
    component every token shares, which a router that leans on it turns into one crowded expert
    (`skew_router`)."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x + shift * hidden ** -0.5).to(device=device, dtype=dtype)


def skew_router(moe: RoutedLayer, strength: float, expert: int = 0) -> RoutedLayer:
    """Tilt the router towards `expert` along the tokens' common direction (in place; returns moe)."""
    with torch.no_grad():
        w = moe.router.weight
        w[expert] += strength * w.shape[1] ** -0.5
    return moe


def imbalance(counts) -> float:
    """max / mean of a list of loads (tokens per expert or rows per rank): 1.0 when balanced."""
    counts = [float(c) for c in counts]
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else 1.0


def routing_plan(moe: RoutedLayer, xs: list[torch.Tensor], ep_size: int) -> dict:
    """Where every token of every rank goes (the explorer's data), for `moe`'s routing of each
    rank's tokens xs[r] with its experts spread over `ep_size` ranks:
    - choices: one row per (rank, token, choice): expert, owner rank, gate, kept;
    - splits[i][j]: rows rank i sends to rank j (kept choices of its tokens on j's experts);
    - tokens_per_expert, rows_per_rank (received: the column sums) and their imbalance."""
    num_experts = moe.num_experts
    local = divide(num_experts, ep_size, "experts over the expert-parallel ranks")
    splits = [[0] * ep_size for _ in range(ep_size)]
    per_expert = [0] * num_experts
    choices = []
    with torch.no_grad():
        for source, x in enumerate(xs):
            r = route(moe.router, x, moe.top_k, moe.capacity_factor)
            rows = zip(r.experts.tolist(), r.weights.tolist(), r.kept.tolist())
            for t, (experts, gates, kept) in enumerate(rows):
                for c, (e, g, keep) in enumerate(zip(experts, gates, kept)):
                    choices.append({"rank": source, "token": t, "choice": c, "expert": e,
                                    "owner": e // local, "gate": g, "kept": keep})
                    if keep:
                        splits[source][e // local] += 1
                        per_expert[e] += 1
    received = [sum(splits[i][j] for i in range(ep_size)) for j in range(ep_size)]
    return {"ep_size": ep_size, "experts_per_rank": local, "choices": choices, "splits": splits,
            "tokens_per_expert": per_expert, "rows_per_rank": received,
            "dropped": sum(not c["kept"] for c in choices),
            "expert_imbalance": imbalance(per_expert), "rank_imbalance": imbalance(received)}


def all_to_all_bytes(splits: list[list[int]], rank: int, row_bytes: int, num_experts: int,
                     count_bytes: int = COUNT_DTYPE.itemsize) -> dict:
    """Bytes `rank` sends to the other ranks in one forward and backward, from the routing's
    splits[i][j] (rows rank i sends to rank j): the counts (E/N integers to each other rank); the
    dispatch (its rows for other ranks' experts); the combine (the results for other ranks' rows).
    The backward runs the two row all-to-alls in reverse: the combine's gradient leaves with the
    dispatch's volume and vice versa. Rows that stay on their rank are never sent. With balanced
    routing each row all-to-all moves T k (N-1)/N rows per rank."""
    n = len(splits)
    out_rows = sum(splits[rank][j] for j in range(n) if j != rank)
    in_rows = sum(splits[i][rank] for i in range(n) if i != rank)
    return {"forward": {"counts": (n - 1) * (num_experts // n) * count_bytes,
                        "dispatch": out_rows * row_bytes, "combine": in_rows * row_bytes},
            "backward": {"combine": out_rows * row_bytes, "dispatch": in_rows * row_bytes}}
