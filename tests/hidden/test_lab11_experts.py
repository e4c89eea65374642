"""Hidden tests of lab 11's exercise, `ExpertParallelMoE.forward` (labs/lab11_experts.py).

Stricter than the public ones: 4 ranks, expert-parallel groups of 4, 3, 2 and 1 ranks whose group
ranks differ from the global ones, one expert per rank and several, top-1 to top-3, other sizes,
a rank without tokens, routings where some ranks receive no row at all, a small capacity factor,
float32 input that is a non-contiguous view, and two calls before one backward.

One launch on 4 ranks runs every case; this file is also its worker (its own reference and
recorders; only helpers.comm_count is shared with the public tests). Float64 results must match
the MoE's definition to 1e-9 (rounding is about 1e-15), float32 to 1e-5.
"""
from __future__ import annotations

import math
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

from labs.lab11_experts import ExpertParallelMoE
from tests.harness import RankFailure, launch_ranks

pytestmark = pytest.mark.exercise("ExpertParallelMoE.forward")

NPROC = 4
PARTITIONS = {"world": [[0, 1, 2, 3]], "trio and solo": [[0, 2, 3], [1]], "two pairs": [[1, 3], [0, 2]]}
F64, F32 = torch.float64, torch.float32
# name: (partition, hidden, ffn, experts per rank, top_k, tokens per global rank, capacity factor,
#        router skew, dtype, non-contiguous input, calls before backward)
CASES = {
    "world top-2": ("world", 6, 10, 2, 2, (11, 7, 13, 9), None, 0.0, F64, False, 1),
    "world one expert each, top-3": ("world", 5, 9, 1, 3, (8, 10, 6, 9), None, 0.0, F64, False, 1),
    "world top-1, one expert takes all": ("world", 6, 8, 2, 1, (9, 9, 9, 9), None, 8.0, F64, False, 1),
    "world, a rank without tokens": ("world", 6, 10, 2, 2, (10, 0, 12, 6), None, 1.0, F64, False, 1),
    "world small capacity": ("world", 6, 10, 2, 2, (12, 12, 12, 12), 0.5, 1.0, F64, False, 1),
    "world float32 view": ("world", 8, 12, 2, 2, (10, 14, 6, 8), None, 0.0, F32, True, 1),
    "trio and solo": ("trio and solo", 7, 11, 2, 2, (9, 13, 8, 10), None, 0.5, F64, False, 1),
    "two pairs skewed": ("two pairs", 6, 10, 3, 2, (14, 10, 12, 16), None, 3.0, F64, False, 1),
    "two calls, one backward": ("world", 6, 10, 2, 2, (8, 12, 10, 6), None, 0.0, F64, False, 2),
}
TOLERANCE = {F64: 1e-9, F32: 1e-5}


def reference(moe, x: torch.Tensor):
    """The MoE by its definition, token by token; returns (out, chosen, kept)."""
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
                row = row + gates[t, c] * F.linear(F.gelu(F.linear(x[t], ex.fc1.weight, ex.fc1.bias)),
                                                   ex.fc2.weight, ex.fc2.bias)
        rows.append(row)
    return (torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])), chosen.tolist(), kept


def aux_of(moe, x: torch.Tensor) -> float:
    probs = torch.softmax(x @ moe.router.weight.t(), dim=-1)
    chosen = probs.topk(moe.top_k, dim=-1).indices
    f = torch.bincount(chosen.reshape(-1), minlength=probs.shape[1]).to(probs.dtype) / max(chosen.numel(), 1)
    return float(probs.shape[1] * (f * probs.sum(0) / max(len(x), 1)).sum())


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (0 for empty tensors)."""
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def run_case(name: str, members: list[int], group) -> dict:
    import torch.distributed as dist

    import labs.lab11_experts as lab
    from helpers.comm_count import count_collectives, count_p2p, patched

    _, hidden, ffn, per_rank, top_k, counts, factor, skew, dtype, view, calls = CASES[name]
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    num_experts = per_rank * n
    with torch.random.fork_rng():
        torch.manual_seed(1000 + hidden * n + len(name))
        moe = lab.MoE(hidden, ffn, num_experts, top_k, factor).to(dtype)
    with torch.no_grad():
        moe.router.weight[0] += skew * hidden ** -0.5
    gen = torch.Generator().manual_seed(31 * n + len(name))
    shift = 2.0 * hidden ** -0.5 if skew else 0.0
    xs = [(torch.randn(counts[g], hidden, generator=gen, dtype=F64) + shift).to(dtype) for g in members]
    douts = [torch.randn(len(x), hidden, generator=gen, dtype=F64).to(dtype) for x in xs]

    params = [moe.router.weight, *moe.experts.parameters()]
    names = [k for k, _ in moe.experts.named_parameters()]
    summed = {k: torch.zeros_like(p) for k, p in moe.experts.named_parameters()}
    splits = [[0] * n for _ in range(n)]                 # splits[i][j]: rows group rank i sends to j
    routed, routed_rows = [0] * num_experts, [[] for _ in range(num_experts)]
    for g, (x, dout) in enumerate(zip(xs, douts)):
        x = x.clone().requires_grad_(True)
        parts = [reference(moe, part) for part in x.tensor_split(calls)]
        out = torch.cat([p[0] for p in parts])
        loss = (out * dout).sum() + 0 * x.sum()   # + 0 * x: a rank without tokens still has a graph
        grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
        for k, grad in zip(names, grads[2:]):
            if grad is not None:
                summed[k] += grad
        for part, (_, chosen, kept) in zip(x.tensor_split(calls), parts):
            for t, (experts, keeps) in enumerate(zip(chosen, kept)):
                for e, keep in zip(experts, keeps):
                    if keep:
                        splits[g][e // per_rank] += 1
                        routed[e] += 1
                        routed_rows[e].append(float(part[t, 0]))
        if g == rank:
            router_grad = torch.zeros_like(params[0]) if grads[1] is None else grads[1]
            expected = {"out": out.detach(), "x_grad": grads[0], "router_grad": router_grad,
                        "aux": aux_of(moe, x.detach().tensor_split(calls)[-1])}
    rep = {"rank": rank, "members": members, "size": n, "num_experts": num_experts, "splits": splits,
           "row_bytes": hidden * xs[0].element_size(), "calls": calls,
           "dropped": sum(not k for x in xs for row in reference(moe, x)[2] for k in row)}
    try:
        layer = ExpertParallelMoE.from_dense(moe, group)
        first = rank * per_rank
        seen = [[] for _ in layer.experts]
        hooks = [e.register_forward_hook(lambda _m, inp, _o, j=j: seen[j].extend(inp[0][:, 0].tolist()))
                 for j, e in enumerate(layer.experts)]
        x = xs[rank].clone()
        if view:   # the same values, stored transposed: a non-contiguous (T, hidden) view
            x = x.t().contiguous().t()
        x.requires_grad_(True)
        a2a = {"forward": [], "backward": []}

        def recorder(phase):
            def make(original):
                def recorded(pg, output, inp, output_splits, input_splits, *args, **kwargs):
                    size, rows_in = pg.size(), (inp.shape[0] if inp.dim() else inp.numel())
                    in_splits = list(input_splits) or [rows_in // size] * size
                    row_bytes = inp.nbytes // rows_in if rows_in else inp.element_size() * math.prod(inp.shape[1:])
                    a2a[phase].append({"floating": inp.is_floating_point(), "numel": inp.numel(),
                                       "sent": sum(s for j, s in enumerate(in_splits) if j != pg.rank()) * row_bytes})
                    return original(pg, output, inp, output_splits, input_splits, *args, **kwargs)
                return recorded
            return patched({"all_to_all_single": make}, required=("all_to_all_single",))

        with count_collectives() as fwd_log, count_p2p(forbid_collectives=False) as fwd_p2p, \
                recorder("forward"):
            out = torch.cat([layer(part) for part in x.tensor_split(calls)])
        for h in hooks:
            h.remove()
        rep.update(out_shape=list(out.shape), tokens=len(x),
                   output=max_diff(out.detach(), expected["out"]),
                   aux=abs(float(layer.aux_loss) - expected["aux"]) if hasattr(layer, "aux_loss") else None,
                   seen=[len(s) for s in seen], routed=[routed[first + j] for j in range(len(seen))],
                   seen_ok=[sorted(s) == sorted(routed_rows[first + j]) for j, s in enumerate(seen)],
                   kinds=[c.kind for c in fwd_log], p2p=len(fwd_p2p.messages))
        if out.requires_grad:
            with count_collectives() as bwd_log, count_p2p(forbid_collectives=False) as bwd_p2p, \
                    recorder("backward"):
                (out * douts[rank]).sum().backward()
            rep["kinds"] += [c.kind for c in bwd_log]
            rep["p2p"] += len(bwd_p2p.messages)
            rep["x_grad"] = float("inf") if x.grad is None else max_diff(x.grad, expected["x_grad"])
            rep["router_grad"] = (float("inf") if layer.router.weight.grad is None else
                                  max_diff(layer.router.weight.grad, expected["router_grad"]))
            worst = 0.0
            for k, p in layer.experts.named_parameters():
                j, leaf = k.split(".", 1)
                want = summed[f"{first + int(j)}.{leaf}"]
                got = torch.zeros_like(want) if p.grad is None else p.grad
                worst = max(worst, max_diff(got, want))
            rep["expert_grad"] = worst
        else:
            rep.update(x_grad=float("inf"), router_grad=float("inf"), expert_grad=float("inf"))
        rep["a2a"] = a2a
    except Exception as err:
        rep["error"] = f"{type(err).__name__}: {err}"
        rep["traceback"] = traceback.format_exc(limit=-4)
    return rep


def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed

    with distributed() as ctx:
        groups = {}
        for pname, partition in PARTITIONS.items():   # every rank creates every group, in this order
            made = [None if len(m) == NPROC else dist.new_group(m) for m in partition]
            groups[pname] = next((m, g) for m, g in zip(partition, made) if ctx.rank in m)
        cases = {}
        for name, spec in CASES.items():
            members, group = groups[spec[0]]
            cases[name] = run_case(name, members, group)
            ctx.report(cases=cases)
            dist.barrier()


# ---------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ExpertParallelMoE.forward is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, env={"DIST_TIMEOUT": "40"},
                        needs=[ExpertParallelMoE.forward])


def case(results, name: str) -> list[dict]:
    """Every rank's report for one case (each in its own group), even from a launch that crashed later."""
    try:
        reps = [results[r]["cases"][name] for r in range(NPROC)]
    except RankFailure as err:
        partial = results.partial
        if not all(name in partial.get(r, {}).get("cases", {}) for r in range(NPROC)):
            raise RankFailure(f"the launch stopped before case {name!r} was reported: {err}") from None
        reps = [partial[r]["cases"][name] for r in range(NPROC)]
    for rep in reps:
        if "error" in rep:
            pytest.fail(f"group rank {rep['rank']} of {rep['members']} ({name}) raised {rep['error']}")
    return reps


def case_is_what_it_claims(name: str, reps: list[dict]) -> None:
    """The test's own routing: some ranks receive no row, a rank has no token, the capacity drops
    choices, the pairs' splits are asymmetric (else a test could not fail)."""
    splits = reps[0]["splits"]
    if name == "world top-1, one expert takes all":
        assert sum(1 for j in range(NPROC) if sum(row[j] for row in splits) == 0) >= 2, splits
    if name == "world, a rank without tokens":
        assert reps[1]["tokens"] == 0
    if name == "world small capacity":
        assert reps[0]["dropped"] > 0
    if name == "two pairs skewed":
        assert any(rep["splits"][0][1] != rep["splits"][1][0] for rep in reps)


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_output_matches_the_dense_layer(results, name):
    """Each rank's output equals the dense MoE's on its tokens, in token order (4 ranks, several groupings)."""
    tol = TOLERANCE[CASES[name][8]]
    reps = case(results, name)
    case_is_what_it_claims(name, reps)
    for rep in reps:
        assert rep["out_shape"] == [rep["tokens"], CASES[name][1]], f"{name}: wrong output shape {rep['out_shape']}"
        assert rep["output"] < tol, (
            f"group rank {rep['rank']} of {rep['members']} ({name}): output off by {rep['output']:.2e}")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_the_dense_layer(results, name):
    """dL/dx, the router's gradient, and each expert's summed over the group's tokens, as in one process."""
    tol = TOLERANCE[CASES[name][8]]
    for rep in case(results, name):
        for what in ("x_grad", "router_grad", "expert_grad"):
            assert rep[what] < tol, (
                f"group rank {rep['rank']} of {rep['members']} ({name}): {what} off by {rep[what]:.2e}")


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][10] == 1])
def test_only_all_to_all_and_bytes_from_the_routing(results, name):
    """Only all_to_all_single (3 forward, 2 backward); each rank sends exactly its routed rows, both ways."""
    for rep in case(results, name):
        who = f"group rank {rep['rank']} of {rep['members']} ({name})"
        assert set(rep["kinds"]) <= {"all_to_all"} and not rep["p2p"], f"{who} used {sorted(set(rep['kinds']))}"
        fwd, bwd = rep["a2a"]["forward"], rep["a2a"]["backward"]
        assert len(fwd) == 3 and len(bwd) == 2, f"{who}: {len(fwd)} forward and {len(bwd)} backward all-to-alls"
        assert not fwd[0]["floating"] and fwd[0]["numel"] <= rep["num_experts"], f"{who}: counts too large"
        r, s, row = rep["rank"], rep["splits"], rep["row_bytes"]
        out_bytes = row * sum(s[r][j] for j in range(rep["size"]) if j != r)
        in_bytes = row * sum(s[i][r] for i in range(rep["size"]) if i != r)
        sent = [fwd[1]["sent"], fwd[2]["sent"], bwd[0]["sent"], bwd[1]["sent"]]
        assert sent == [out_bytes, in_bytes, out_bytes, in_bytes], (
            f"{who}: sent {sent} bytes (dispatch, combine, and their backwards); the routing gives "
            f"{[out_bytes, in_bytes, out_bytes, in_bytes]}")


@pytest.mark.parametrize("name", list(CASES))
def test_each_expert_runs_only_on_its_rows(results, name):
    """Each local expert runs on exactly the rows routed to it from every rank of its group."""
    for rep in case(results, name):
        assert rep["seen"] == rep["routed"] and all(rep["seen_ok"]), (
            f"group rank {rep['rank']} of {rep['members']} ({name}): local experts ran on {rep['seen']} rows, "
            f"{rep['routed']} were routed to them" + ("" if all(rep["seen_ok"]) else ", and not those rows"))


def test_aux_loss_of_the_last_call(results):
    """aux_loss after forward is the load-balancing loss of the tokens of the last call."""
    for name in ("world top-2", "two calls, one backward"):
        for rep in case(results, name):
            assert rep["aux"] is not None and rep["aux"] < 1e-9, f"{name}: aux_loss missing or wrong"


def test_one_rank_in_process_with_capacity_and_top_3():
    """World size 1, in this process: capacity drops and top-3 routing give the dense layer's output."""
    import labs.lab11_experts as lab
    from helpers.dist import distributed

    with distributed():
        with torch.random.fork_rng():
            torch.manual_seed(3)
            moe = lab.MoE(5, 7, 4, 3, capacity_factor=0.75).double()
        x = torch.randn(9, 5, generator=torch.Generator().manual_seed(4), dtype=F64)
        out = ExpertParallelMoE.from_dense(moe)(x)
        assert (out - reference(moe, x)[0]).abs().max() < 1e-9


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
