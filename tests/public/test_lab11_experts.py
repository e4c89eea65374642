"""Public tests of lab 11's exercise, `ExpertParallelMoE.forward` (labs/lab11_experts.py).

Run:  ./run.sh check 11      (or: .venv/bin/python -m pytest tests/public/test_lab11_experts.py)

One launch on 3 ranks (gloo on the CPU, or nccl with 3 GPUs) runs every case; this file is also
its worker. World size 1 runs in this process. Each case builds one MoE (the same on every rank)
and every rank's tokens, splits the experts over the ranks with `ExpertParallelMoE.from_dense`,
runs this rank's tokens forward and a random gradient backward, and compares with the MoE's
definition computed token by token here (`reference`, float64: a correct layer differs by
rounding, about 1e-15; TOL = 1e-9): the output and dL/dx on this rank's tokens, the router's
gradient from them, and each local expert's gradient summed over every rank's tokens. Around the
call it records every all_to_all_single with its split sizes, every other collective
(helpers.comm_count.count_collectives) and point-to-point message (count_p2p), and the rows each
local expert runs on (forward hooks).
"""
from __future__ import annotations

import math
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

from labs.lab11_experts import ExpertParallelMoE
from tests.harness import RankFailure, Ranks, launch_ranks

pytestmark = pytest.mark.exercise("ExpertParallelMoE.forward")

NPROC = 3
TOL = 1e-9
SUBGROUPS = ([1, 2], [0])   # ranks 1, 2 share their experts (group ranks 0, 1); rank 0 holds them all
# name: (hidden, ffn, experts per rank, top_k, tokens on each rank, capacity factor, router skew, dtype)
CASES = {   # in this order on purpose: ./run.sh check shows the first failure, and top-1 names most
    "top-1, other token counts": (8, 12, 1, 1, (9, 4, 14), None, 0.0, torch.float64),
    "top-2": (8, 16, 2, 2, (12, 12, 12), None, 0.0, torch.float64),
    "float32": (8, 16, 2, 2, (10, 10, 10), None, 0.0, torch.float32),
    "skewed router": (8, 16, 2, 2, (16, 16, 16), None, 3.0, torch.float64),
    "skewed, top-1": (8, 16, 1, 1, (20, 20, 20), None, 2.0, torch.float64),
    "capacity": (8, 16, 2, 2, (12, 12, 12), 1.0, 1.0, torch.float64),
    "a rank without tokens": (8, 16, 2, 2, (10, 0, 7), None, 0.0, torch.float64),
    "subgroup": (8, 16, 2, 2, (10, 10, 10), None, 0.0, torch.float64),
}
TOLERANCE = {torch.float64: TOL, torch.float32: 1e-5}
SKEWED = ("skewed router", "skewed, top-1")


# ---------------------------------------------------------------------------------- the reference
def reference(moe, x: torch.Tensor, gated: bool = True):
    """The MoE by its definition, token by token: softmax of the router's logits, the top-k
    experts, gates renormalised over the top-k (k > 1) or the probability itself (k = 1), at most
    ceil(factor T k / E) assignments per expert (first choices first, then tokens in order), and
    out[t] = sum over t's kept choices of gate * expert(x[t]). Returns (out, chosen, kept)."""
    weight, top_k, factor = moe.router.weight, moe.top_k, moe.capacity_factor
    probs = torch.softmax(x @ weight.t(), dim=-1)
    tokens, num_experts = probs.shape
    top, chosen = probs.topk(top_k, dim=-1)
    gates = top / top.sum(-1, keepdim=True) if top_k > 1 else top
    capacity = math.ceil(factor * tokens * top_k / num_experts) if factor is not None else None
    load, kept = [0] * num_experts, [[False] * top_k for _ in range(tokens)]
    for c in range(top_k):
        for t in range(tokens):
            e = int(chosen[t, c])
            if capacity is None or load[e] < capacity:
                load[e] += 1
                kept[t][c] = True
    rows = []
    for t in range(tokens):
        row = torch.zeros_like(x[t])
        for c in range(top_k):
            if kept[t][c]:
                ex = moe.experts[int(chosen[t, c])]
                y = F.linear(F.gelu(F.linear(x[t], ex.fc1.weight, ex.fc1.bias)), ex.fc2.weight, ex.fc2.bias)
                row = row + (gates[t, c] if gated else 1.0) * y
        rows.append(row)
    out = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
    return out, chosen.tolist(), kept


def reference_aux(moe, x: torch.Tensor) -> float:
    """Switch's load-balancing loss E * sum_i f_i P_i on x's routing (f over the T k choices)."""
    probs = torch.softmax(x @ moe.router.weight.t(), dim=-1)
    chosen = probs.topk(moe.top_k, dim=-1).indices
    f = torch.bincount(chosen.reshape(-1), minlength=probs.shape[1]).to(probs.dtype) / max(chosen.numel(), 1)
    return float(probs.shape[1] * (f * probs.sum(0) / max(len(x), 1)).sum())


# ---------------------------------------------------------------------------------------- worker
def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (0 for empty tensors)."""
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def run_case(name: str, group=None) -> dict:
    """One case of CASES on `group` (None: every rank): its MoE and tokens, then `measure`."""
    import torch.distributed as dist

    import labs.lab11_experts as lab

    hidden, ffn, per_rank, top_k, token_counts, factor, skew, dtype = CASES[name]
    n = dist.get_world_size(group)
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    with torch.random.fork_rng():
        torch.manual_seed(sum(token_counts) + n)
        moe = lab.MoE(hidden, ffn, per_rank * n, top_k, factor).to(dtype)
    with torch.no_grad():   # tilt the router towards expert 0 (on group rank 0) along the tokens' mean
        moe.router.weight[0] += skew * hidden ** -0.5
    gen = torch.Generator().manual_seed(7 * n + len(name))
    xs = [(torch.randn(token_counts[g], hidden, generator=gen, dtype=torch.float64) + 2.0 * hidden ** -0.5
           * (skew > 0)).to(dtype) for g in members]
    douts = [torch.randn(len(x), hidden, generator=gen, dtype=torch.float64).to(dtype) for x in xs]
    return measure(moe, xs, douts, group, per_rank)


def one_process(moe, xs: list, douts: list, rank: int, per_rank: int, calls: int = 1) -> dict:
    """The MoE in one process on every group rank's tokens xs[g] (in `calls` consecutive calls),
    backward from the output gradient douts[g]: for group rank `rank` its output, dL/dx, router
    gradient, output without the gates and aux loss (of its last call), in "expected"; each
    expert's gradient summed over every rank's tokens ("summed"); splits[i][j], the rows group rank
    i sends to group rank j; per expert, how many rows are routed to it and their first elements;
    and how many (token, expert) choices the capacity dropped."""
    n = len(xs)
    params = [moe.router.weight, *moe.experts.parameters()]
    expert_names = [k for k, _ in moe.experts.named_parameters()]
    summed = {k: torch.zeros_like(p) for k, p in moe.experts.named_parameters()}
    splits = [[0] * n for _ in range(n)]                 # splits[i][j]: rows group rank i sends to j
    routed, routed_rows = [0] * (per_rank * n), [[] for _ in range(per_rank * n)]
    dropped, expected = 0, {}
    for g, (x, dout) in enumerate(zip(xs, douts)):
        x = x.clone().requires_grad_(True)
        parts = [(part, *reference(moe, part)) for part in x.tensor_split(calls)]
        out = torch.cat([p[1] for p in parts])
        loss = (out * dout).sum() + 0 * x.sum()   # + 0 * x: a rank without tokens still has a graph
        grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
        for k, grad in zip(expert_names, grads[2:]):
            if grad is not None:
                summed[k] += grad
        for part, _, chosen, kept in parts:
            for t, (experts, keeps) in enumerate(zip(chosen, kept)):
                for e, keep in zip(experts, keeps):
                    dropped += not keep
                    if keep:
                        splits[g][e // per_rank] += 1
                        routed[e] += 1
                        routed_rows[e].append(float(part[t, 0]))
        if g == rank:
            pieces = x.detach().tensor_split(calls)
            expected = {"out": out.detach(), "x_grad": grads[0],
                        "router_grad": torch.zeros_like(params[0]) if grads[1] is None else grads[1],
                        "ungated": torch.cat([reference(moe, p, gated=False)[0] for p in pieces]),
                        "aux": reference_aux(moe, pieces[-1])}
    return {"expected": expected, "summed": summed, "splits": splits, "routed": routed,
            "routed_rows": routed_rows, "dropped": dropped}


class WrongGroup(RuntimeError):
    """A collective issued on a group other than the layer's (raised before it runs: no rank hangs)."""


def record_all_to_all(calls: list, group_size: int | None = None):
    """Inside the block every all_to_all_single (still run) appends to `calls` its dtype, size,
    split sizes and the bytes it sends to the other ranks; one issued on a group whose size is not
    `group_size` (the layer's group) raises WrongGroup instead of running."""
    from helpers.comm_count import patched

    def make(original):
        def recorded(pg, output, inp, output_splits, input_splits, *args, **kwargs):
            size = pg.size()
            if group_size is not None and size != group_size:
                raise WrongGroup(
                    f"all_to_all_single was called on a group of {size} rank(s), but this layer's group "
                    f"(self.group) has {group_size}: every collective of the layer goes to self.group (the "
                    "other ranks of the world are not in it and never make the matching call)")
            rows_in = inp.shape[0] if inp.dim() else inp.numel()
            in_splits = list(input_splits) or [rows_in // size] * size
            row_bytes = inp.nbytes // rows_in if rows_in else inp.element_size() * math.prod(inp.shape[1:])
            calls.append({"dtype": str(inp.dtype), "numel": inp.numel(), "floating": inp.is_floating_point(),
                          "sent": sum(s for j, s in enumerate(in_splits) if j != pg.rank()) * row_bytes,
                          "row_bytes": row_bytes, "input_splits": in_splits,
                          "output_splits": list(output_splits)})
            return original(pg, output, inp, output_splits, input_splits, *args, **kwargs)
        return recorded
    return patched({"all_to_all_single": make}, required=("all_to_all_single",))


def measure(moe, xs: list, douts: list, group, per_rank: int, calls: int = 1,
            transposed: bool = False) -> dict:
    """Splits `moe`'s experts over `group` (ExpertParallelMoE.from_dense), runs this group rank's
    tokens xs[rank] forward (in `calls` consecutive calls; `transposed`: as a non-contiguous view)
    and douts[rank] backward, and compares with `one_process`. The report the tests read: the
    differences, the collectives and point-to-point messages of each pass, every all-to-all
    (`record_all_to_all`), the rows each local expert ran on, and the routing's own numbers."""
    import torch.distributed as dist

    from helpers.comm_count import count_collectives, count_p2p

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    ref = one_process(moe, xs, douts, rank, per_rank, calls)
    expected, routed, routed_rows = ref["expected"], ref["routed"], ref["routed_rows"]
    rep = {"rank": rank, "members": members, "size": n, "num_experts": per_rank * n, "top_k": moe.top_k,
           "splits": ref["splits"], "row_bytes": xs[0].shape[1] * xs[0].element_size(),
           "dropped": ref["dropped"], "tokens": len(xs[rank]), "calls": calls}
    try:
        layer = ExpertParallelMoE.from_dense(moe, group)
        first = rank * per_rank
        seen, expert_calls = [[] for _ in layer.experts], [0] * len(layer.experts)

        def saw(j, rows):
            seen[j].extend(rows[:, 0].tolist())
            expert_calls[j] += 1
        hooks = [e.register_forward_hook(lambda _m, inp, _o, j=j: saw(j, inp[0])) for j, e in enumerate(layer.experts)]
        x = xs[rank].clone()
        if transposed:   # the same values, stored transposed: a non-contiguous (T, hidden) view
            x = x.t().contiguous().t()
        x.requires_grad_(True)
        a2a = {"forward": [], "backward": []}
        with count_collectives() as fwd_log, count_p2p(forbid_collectives=False) as fwd_p2p, \
                record_all_to_all(a2a["forward"], n):
            out = layer(x) if calls == 1 else torch.cat([layer(part) for part in x.tensor_split(calls)])
        for h in hooks:
            h.remove()
        if n > 1 and not fwd_log:
            rep["error"] = (f"SkippedCollective: this rank made no collective call in its forward ({len(x)} token(s)), "
                            "while the other ranks of its group wait for it in theirs. A rank without tokens still "
                            "takes part in every collective (it sends and receives zero rows), and so does a rank "
                            "whose rows all stay local")
            rep["traceback"], rep["a2a"] = "", a2a
            return rep
        rep.update(out_shape=list(out.shape),
                   output=max_diff(out.detach(), expected["out"]),
                   ungated=max_diff(out.detach(), expected["ungated"]),
                   permuted=permutation_of(out.detach(), expected["out"]),
                   aux=abs(float(layer.aux_loss) - expected["aux"]) if hasattr(layer, "aux_loss") else None,
                   requires_grad=out.requires_grad, seen=[len(s) for s in seen], expert_calls=expert_calls,
                   seen_ok=[sorted(s) == sorted(routed_rows[first + j]) for j, s in enumerate(seen)],
                   routed=[routed[first + j] for j in range(len(seen))],
                   fwd_kinds=[c.kind for c in fwd_log], fwd_p2p=len(fwd_p2p.messages))
        if not out.requires_grad:
            rep["backward_error"] = ("the output does not require grad: autograd cannot reach x, the router "
                                     "or the experts")
        else:
            with count_collectives() as bwd_log, count_p2p(forbid_collectives=False) as bwd_p2p, \
                    record_all_to_all(a2a["backward"], n):
                (out * douts[rank]).sum().backward()
            rep.update(bwd_kinds=[c.kind for c in bwd_log], bwd_p2p=len(bwd_p2p.messages),
                       x_grad=float("inf") if x.grad is None else max_diff(x.grad, expected["x_grad"]),
                       router_grad=float("inf") if layer.router.weight.grad is None else
                       max_diff(layer.router.weight.grad, expected["router_grad"]))
            missing, worst = [], 0.0
            for k, p in layer.experts.named_parameters():
                j, leaf = k.split(".", 1)
                want = ref["summed"][f"{first + int(j)}.{leaf}"]
                if p.grad is None:
                    if want.abs().max() > 0:
                        missing.append(k)
                else:
                    worst = max(worst, max_diff(p.grad, want))
            rep.update(expert_grad=worst, missing_expert_grads=missing)
        rep["a2a"] = a2a
    except Exception as err:
        rep["error"] = f"{type(err).__name__}: {err}"
        rep["traceback"] = traceback.format_exc(limit=-4)
    return rep


def permutation_of(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """True when out holds expected's rows, but not all in their places."""
    if out.shape != expected.shape or len(out) < 2:
        return False
    distance = torch.cdist(out.double(), expected.double())
    matched = distance.min(dim=1)
    return bool((matched.values < 1e-6).all() and (matched.indices != torch.arange(len(out))).any()
                and len(set(matched.indices.tolist())) == len(out))


def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed, new_group

    with distributed() as ctx:
        groups = [new_group(members, name=f"experts of {members}") for members in SUBGROUPS]   # every rank, every group
        mine = next(g for g, members in zip(groups, SUBGROUPS) if ctx.rank in members)
        cases = {}
        for name in CASES:   # reported one by one: a case that crashes the ranks leaves the others
            cases[name] = run_case(name, mine if name == "subgroup" else None)
            ctx.report(cases=cases)
            if cases[name].get("error", "").startswith("SkippedCollective"):
                raise SystemExit(cases[name]["error"])    # the other ranks wait in a collective: end now
            dist.barrier()


# ---------------------------------------------------------------------------------------- launch
SPLITS_HINT = (
    "gloo stopped the run: a rank received more data than it expected (\"Received data size "
    "doesn't match expected size\"). In all_to_all_single rank i must pass as output_split_sizes "
    "exactly what every rank sends it: with uneven routing a rank does not receive as many rows as "
    "it sends, so exchange the counts first (dist.all_to_all_single of the per-expert counts) and "
    "build both split lists from them. (An all_gather of tensors of different sizes stops gloo the "
    "same way.)")


TIMEOUT_HINT = (
    "a rank waited in a collective until the process group's timeout: every rank of the group "
    "must make the same collective calls in the same order, a rank without tokens included (it "
    "sends and receives zero rows, but it still takes part).")


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ExpertParallelMoE.forward is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=180, env={"DIST_TIMEOUT": "30"},
                        needs=[ExpertParallelMoE.forward])


def case(results: Ranks, name: str, ranks=None) -> list[dict]:
    """Every listed rank's report for one case; a case that raised fails here with its error, and
    a launch that crashed still gives the cases reported before it."""
    members = SUBGROUPS[0] if name == "subgroup" else range(NPROC)
    ranks = members if ranks is None else ranks
    try:
        reps = [results[r]["cases"][name] for r in ranks]
    except RankFailure as err:
        partial = results.partial
        skipped = [c[name]["error"] for c in (partial.get(r, {}).get("cases", {}) for r in range(NPROC))
                   if name in c and c[name].get("error", "").startswith("SkippedCollective")]
        if skipped:
            pytest.fail(f"case {name!r}: {skipped[0]}")
        if not all(name in partial.get(r, {}).get("cases", {}) for r in ranks):
            if "doesn't match expected size" in results.output:   # gloo's words, then it aborts
                raise RankFailure(f"case {name!r}: {SPLITS_HINT} (The launch stopped: {err})") from None
            if "imed out" in str(err):
                raise RankFailure(f"case {name!r}: {TIMEOUT_HINT} (The launch stopped: {err})") from None
            raise RankFailure(f"the launch failed before case {name!r} was reported: {err}") from None
        reps = [partial[r]["cases"][name] for r in ranks]
    for rep in reps:
        if "error" in rep:
            extra = ("" if rep["error"].startswith(("WrongGroup", "SkippedCollective")) else
                     " The counts are whole numbers: count rows per expert in an integer dtype "
                     "(torch.bincount gives int64) and pass split sizes as Python ints."
                     if "must be tuple of ints" in rep["error"] or "type float" in rep["error"] else
                     " all_to_all_single needs, on every rank, output_split_sizes that match what the "
                     "others send: exchange the counts first." if "split" in rep["error"].lower() else
                     f" Probably {TIMEOUT_HINT}" if "imed out" in rep["error"] else "")
            pytest.fail(f"group rank {rep['rank']} ({name}): ExpertParallelMoE.forward raised "
                        f"{rep['error']}.{extra}\n{rep['traceback']}")
    return reps


GROUP_HINT = ("The cases over every rank pass: use the layer's group (self.group) for every collective "
              "and its ranks and sizes (self.ep_rank, self.ep_size), not the world's.")


def basics_failing(results, *names) -> str:
    """The first of `names` whose output is wrong somewhere, or ""."""
    for name in names:
        try:
            reps = case(results, name)
        except BaseException:
            return name
        if any(not rep["output"] < TOLERANCE[CASES[name][-1]] for rep in reps):
            return name
    return ""


def output_message(results, rep: dict, name: str) -> str:
    what = (f"group rank {rep['rank']} ({name}): the output differs from the MoE's by {rep['output']:.2e}. ")
    if rep["ungated"] < 1e-6 * max(1.0, rep["output"]):
        return what + ("It equals the experts' outputs added WITHOUT the gate weights: the combine "
                       "multiplies each returned row by its gate, routing.weights[token, choice], "
                       "before adding it to its token's output.")
    if rep["permuted"]:
        return what + ("It holds the right rows in the wrong places: the results come back in the "
                       "order the rows were sent (sorted by expert), not in token order; put each "
                       "row back at its token (index_add with the sent rows' token ids).")
    if name == "subgroup" and not basics_failing(results, "top-2"):
        return what + GROUP_HINT
    if name == "capacity" and not basics_failing(results, "top-2", "skewed router"):
        return what + ("The cases without a capacity pass: a choice the routing dropped "
                       "(routing.kept False: its expert was full) adds nothing to its token's output "
                       "and is not sent.")
    if name in SKEWED + ("top-1, other token counts",) and not basics_failing(results, "top-2"):
        return what + ("The balanced case passes: with uneven split sizes, rank i's rows arrive as "
                       "one block per source rank, of the size that rank sent (the counts you "
                       "received), not of the size this rank sends, nor T k / N.")
    if not all(rep.get("seen_ok", [True])):
        return what + ("Some expert ran on rows that were not routed to it: rows arrive grouped by source "
                       "rank, and inside each source's block by local expert (the counts you received say "
                       "how many of each), not the other way round.")
    return what + ("Each token's output is the gate-weighted sum of the outputs of the experts it "
                   "was routed to, whichever rank holds them.")


def case_is_what_it_claims(name: str, rep: dict) -> None:
    """The test's own inputs (its routing, not the layer's): the skewed cases send uneven split
    sizes, the capacity case drops choices, a rank has no token (else a test could not fail)."""
    splits = rep["splits"]
    if name in SKEWED:
        received = [sum(row[j] for row in splits) for j in range(len(splits))]
        assert max(received) >= 2 * min(received), f"{name}: routing not skewed enough: {splits}"
        assert any(splits[i][j] != splits[j][i] for i in range(NPROC) for j in range(NPROC)), splits
    if name == "capacity":
        assert rep["dropped"] > 0, "the capacity case drops nothing"
    if name == "a rank without tokens":
        assert 0 in CASES[name][4]


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_output_matches_the_dense_layer(results, name):
    """Every rank's output equals the dense MoE's on its tokens, in token order."""
    tol = TOLERANCE[CASES[name][-1]]
    reps = case(results, name)
    case_is_what_it_claims(name, reps[0])
    for rep in reps:
        assert rep["out_shape"] == [rep["tokens"], CASES[name][0]], (
            f"group rank {rep['rank']} ({name}): returned shape {rep['out_shape']}; x's shape is "
            f"[{rep['tokens']}, {CASES[name][0]}]")
        assert rep["output"] < tol, output_message(results, rep, name)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_the_dense_layer(results, name):
    """dL/dx and the router's gradient on every rank, each expert's summed over every rank's tokens."""
    tol = TOLERANCE[CASES[name][-1]]
    for rep in case(results, name):
        r = rep["rank"]
        assert "backward_error" not in rep, f"group rank {r} ({name}): {rep['backward_error']}"
        first = basics_failing(results, name)
        fix = f" (First make the output of {first!r} right.)" if first else ""
        assert not rep["missing_expert_grads"], (
            f"group rank {r} ({name}): no gradient reached {rep['missing_expert_grads']} although tokens "
            "were routed to them: the rows must travel through a differentiable all-to-all (the "
            "lab's all_to_all, an autograd function) both ways, or autograd stops at the collective" + fix)
        assert rep["expert_grad"] < tol, (
            f"group rank {r} ({name}): the local experts' gradients differ by {rep['expert_grad']:.2e} from "
            "the dense experts' summed over every rank's tokens: the backward must bring each rank's "
            "gradient rows to the expert's owner (the all-to-all's backward)" + fix)
        dispatch = rep["a2a"]["forward"][1]["sent"] if len(rep["a2a"]["forward"]) == 3 else None
        if rep["router_grad"] >= tol and dispatch is not None and dispatch != expected_bytes(rep)[0]:
            pytest.fail(f"group rank {r} ({name}): the router's gradient differs by {rep['router_grad']:.2e}, and the "
                        f"dispatch sent {dispatch} bytes where the routing sends {expected_bytes(rep)[0]}: rows went "
                        "where they were not routed (every token to every rank?), so the gates were computed, and "
                        "their gradients collected, on other ranks' router copies. Send each kept (token, expert) "
                        "choice to its expert's owner only, and apply the gates on the token's own rank")
        assert rep["router_grad"] < tol, (
            f"group rank {r} ({name}): the router's gradient differs by {rep['router_grad']:.2e}"
            + (" (none reached it)" if rep["router_grad"] == float("inf") else "") + ": the gates "
            "(routing.weights, differentiable: not detached) must multiply the returned rows, the router's "
            "only path to the task loss" + fix)
        backward_a2a = len(rep["a2a"]["backward"])
        assert rep["x_grad"] < tol, (
            f"group rank {r} ({name}): dL/dx differs by {rep['x_grad']:.2e}: the gradients of the rows "
            "sent away must come back to their tokens (all_to_all in both directions)"
            + (f"; the backward made {backward_a2a} all-to-all(s) where the two row exchanges make 2: a row "
               "exchange went through a collective autograd cannot follow (dist.all_to_all_single itself): "
               "send the rows with the lab's all_to_all, both ways" if backward_a2a < 2 else "") + fix)


def test_aux_loss_recorded(results):
    """After forward, aux_loss holds the load-balancing loss of this rank's tokens (self.route does it)."""
    for rep in case(results, "top-2"):
        assert rep["aux"] is not None and rep["aux"] < 1e-9, (
            f"group rank {rep['rank']}: aux_loss is {'missing' if rep['aux'] is None else 'wrong'}: route "
            "with self.route(x), which records it")


@pytest.mark.parametrize("name", list(CASES))
def test_only_all_to_all_three_forward_two_backward(results, name):
    """Only all_to_all_single moves data: three calls per forward (counts, rows, results), two per backward."""
    for rep in case(results, name):
        r = rep["rank"]
        others = sorted(set(rep["fwd_kinds"] + rep.get("bwd_kinds", [])) - {"all_to_all"})
        rows_only = [c["floating"] for c in rep["a2a"]["forward"]] == [True, True]
        assert "all_gather" not in others or not rows_only, (
            f"group rank {r} ({name}) exchanged the counts with an all_gather: every rank then holds "
            "the whole N x E table, where it needs only the counts the others send it: "
            "all_to_all_single of the per-expert counts (E/N integers to each rank)")
        assert "all_gather" not in others, (
            f"group rank {r} ({name}) called {others}: an all_gather hands every token (or every "
            "expert) to every rank, N times the traffic of sending each row only to the owner of its "
            "expert. Send each row with all_to_all_single to the rank that holds its expert")
        assert not others and not rep["fwd_p2p"] and not rep.get("bwd_p2p"), (
            f"group rank {r} ({name}) used {others or 'point-to-point messages'}: expert parallelism "
            "needs only all_to_all_single (the counts, the rows, the results)")
        assert len(rep["a2a"]["forward"]) == 3, (
            f"group rank {r} ({name}): {len(rep['a2a']['forward'])} all_to_all_single calls in forward; "
            "expected 3: the counts, then the rows to the experts' owners, then the results back")
        counts = rep["a2a"]["forward"][0]
        assert not counts["floating"] and counts["numel"] <= rep["num_experts"], (
            f"group rank {r} ({name}): the first all-to-all carried {counts['numel']} {counts['dtype']} "
            f"elements; the counts are at most E = {rep['num_experts']} integers")
        assert len(rep["a2a"]["backward"]) == 2, (
            f"group rank {r} ({name}): {len(rep['a2a']['backward'])} all_to_all_single calls in backward; "
            "the two row all-to-alls' backwards make 2 (use the lab's all_to_all for the rows)")


def expected_bytes(rep: dict) -> tuple[int, int]:
    """(dispatch, combine) bytes this rank sends to the other ranks, from the routing."""
    r, splits, row = rep["rank"], rep["splits"], rep["row_bytes"]
    out_rows = sum(splits[r][j] for j in range(rep["size"]) if j != r)
    in_rows = sum(splits[i][r] for i in range(rep["size"]) if i != r)
    return out_rows * row, in_rows * row


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_rank_follow_the_routing(results, name):
    """Each row goes only to its expert's owner: bytes sent to other ranks equal the routing's, both ways."""
    for rep in case(results, name):
        if len(rep["a2a"]["forward"]) != 3 or len(rep["a2a"]["backward"]) != 2:
            pytest.fail(f"group rank {rep['rank']} ({name}): not three forward and two backward "
                        "all-to-alls (see test_only_all_to_all_three_forward_two_backward)")
        dispatch, combine = expected_bytes(rep)
        (_, f_dispatch, f_combine), (b_combine, b_dispatch) = rep["a2a"]["forward"], rep["a2a"]["backward"]
        for what, call, want in (("forward dispatch", f_dispatch, dispatch), ("forward combine", f_combine, combine),
                                 ("backward of the combine", b_combine, dispatch),
                                 ("backward of the dispatch", b_dispatch, combine)):
            assert call["sent"] == want, (
                f"group rank {rep['rank']} ({name}): the {what} sent {call['sent']} bytes to other ranks "
                f"(splits {call['input_splits']}, {call['row_bytes']} bytes a row); the routing sends "
                f"{want // rep['row_bytes']} rows = {want} bytes. Send one row per kept (token, expert) "
                "choice, only to the rank that owns that expert (sending every token to every rank "
                "moves N times more), and nothing for dropped choices")


@pytest.mark.parametrize("name", list(CASES))
def test_each_expert_runs_only_on_the_rows_routed_to_it(results, name):
    """Each local expert runs on exactly the rows routed to it from every rank, no more, no others."""
    for rep in case(results, name):
        for j, (seen, routed, same) in enumerate(zip(rep["seen"], rep["routed"], rep["seen_ok"])):
            e = rep["rank"] * (rep["num_experts"] // rep["size"]) + j
            assert seen == routed, (
                f"group rank {rep['rank']} ({name}): expert {e} ran on {seen} rows, but {routed} (token, "
                "expert) choices of all ranks were routed to it. Run each expert only on the rows sent "
                "to it: running every local expert on every received row (or on every token) computes "
                "the experts densely, E/N times the work, and masks it afterwards")
            assert same, (
                f"group rank {rep['rank']} ({name}): expert {e} ran on rows that were not routed to it: "
                "rows arrive grouped by source rank, then by expert inside each source's block (the "
                "counts say how many)")


@pytest.mark.parametrize("name", list(CASES))
def test_each_expert_runs_once_per_forward(results, name):
    """Each local expert is called at most once per forward (its rows from every rank together), once if it has rows."""
    for rep in case(results, name):
        for j, (calls, routed) in enumerate(zip(rep["expert_calls"], rep["routed"])):
            e = rep["rank"] * (rep["num_experts"] // rep["size"]) + j
            assert calls <= rep["calls"] and (calls >= 1 or routed == 0), (
                f"group rank {rep['rank']} ({name}): expert {e} was called {calls} times in {rep['calls']} forward(s)"
                + (" although rows were routed to it" if calls == 0 else
                   f": once per piece (one piece per source rank, {rep['size']} ranks). Run each local expert once "
                   "per forward, on its pieces from every rank concatenated: one large matmul instead of N small "
                   "ones (on a GPU, small matmuls leave it idle), and split its result back into the pieces' places"))


def test_on_a_subgroup(results):
    """Ranks 1, 2 split the experts over new_group([1, 2]) while rank 0 holds them all: group ranks and sizes."""
    first = basics_failing(results, "top-2")
    for members in SUBGROUPS:
        for rep in case(results, "subgroup", ranks=members):
            assert rep["output"] < TOL and rep.get("expert_grad", 1.0) < TOL, (
                f"global rank {members[rep['rank']]} on the group {members}: output off by "
                f"{rep['output']:.2e}. " + (f"First make the {first!r} case pass." if first else GROUP_HINT))
    solo = case(results, "subgroup", ranks=SUBGROUPS[1])[0]
    assert all(call["sent"] == 0 for phase in solo["a2a"].values() for call in phase), (
        "rank 0 alone in its group sent bytes to other ranks")


def test_on_one_rank_in_process():
    """World size 1, in this process: the layer holds every expert and returns the dense layer's output."""
    import labs.lab11_experts as lab
    from helpers.dist import distributed

    with distributed():
        moe = lab.make_moe(6, 10, 3, 2, dtype=torch.float64)
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        out = ExpertParallelMoE.from_dense(moe)(x)
        diff = max_diff(out, reference(moe, x)[0])
        assert diff < TOL, f"on one rank (every expert local) the output differs from the MoE's by {diff:.2e}"


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
