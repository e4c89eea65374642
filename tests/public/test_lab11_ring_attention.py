"""Public tests of lab 11's exercise, `ring_attention` (labs/lab11_ring_attention.py).

Run:  ./run.sh check 11      (or: .venv/bin/python -m pytest tests/public/test_lab11_ring_attention.py)

One launch on 4 ranks (gloo on the CPU, or nccl with 4 GPUs) runs every case; this file is also
its worker. World size 1 runs in this process. Each case builds q, k, v for the whole sequence
(the same on every rank, float64), gives each rank its contiguous shard, runs ring_attention and
backpropagates a random gradient, and compares output and gradients with one process's
F.scaled_dot_product_attention on the whole sequence: a correct ring differs by rounding only
(about 1e-15; TOL = 1e-10 separates that from any real mistake). One case is bfloat16 as torch
tests its own ring (q, k, v uniform in [0, 1), the backward of out.sum(), absolute tolerances
1e-3 N for the output and 8e-3 N for the gradients, against SDPA in float64). Around the call it
records (labs/lab11_ring_trace.py's trace_ring and helpers.comm_count.count_p2p) every message
posted and waited for and the storage it used, every attention_block call, the receive buffers
alive at each block, and what autograd keeps for the backward (lab 07's SavedTensorBytes);
count_p2p makes any built-in collective raise. 4 ranks, so that a ring that keeps every received
block (N - 1 = 3 of them) holds more than the two a ring needs.
"""
from __future__ import annotations

import sys

import pytest
import torch

from labs.lab11_ring_attention import ring_attention
from tests.harness import RankFailure, launch_ranks

pytestmark = pytest.mark.exercise("ring_attention")

NPROC = 4
TOL = 1e-10
SUBGROUPS = ([1, 2, 3], [0])     # ranks 1-3 run a ring of three (group ranks 0-2); rank 0 alone
# name: (batch, heads, seq_local, head_dim, causal, logit scale, layout of the inputs)
CASES = {
    "full": (2, 2, 6, 4, False, 1.0, "contiguous"),
    "causal": (2, 2, 6, 4, True, 1.0, "contiguous"),
    "large scores": (1, 2, 5, 4, False, 300.0, "contiguous"),
    "large scores causal": (1, 2, 5, 4, True, 300.0, "contiguous"),
    "transposed views": (2, 3, 4, 4, True, 1.0, "transposed"),
    "long blocks": (1, 2, 32, 4, False, 1.0, "contiguous"),
}


BF16 = (8, 8, 64, 32, True, 1.0, "torch's test")    # torch's own ring test: sizes, inputs and loss


def run_case(batch, heads, seq_local, head_dim, causal, logit_scale, layout, group=None, seed=0,
             dtype=torch.float64, device="cpu") -> dict:
    """One ring_attention call on this rank's shard, forward and backward, traced and compared
    (differences measured in float64, against SDPA in float64 on the same values). layout
    "transposed": the shards are non-contiguous views; "torch's test": uniform inputs, the
    backward of out.sum()."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import labs.lab11_ring_attention as lab
    from helpers.comm_count import count_p2p
    from labs.lab07_memory import SavedTensorBytes
    from labs.lab11_ring_trace import trace_ring

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    uniform = layout == "torch's test"
    q, k, v = lab.sample_qkv(batch, heads, seq_local * n, head_dim, seed=seed, logit_scale=logit_scale,
                             dtype=dtype, device=device, uniform=uniform)
    full = [t.detach().double().clone().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal)
    dout = (torch.ones(expected.shape, dtype=dtype) if uniform else
            torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1),
                        dtype=torch.float64).to(dtype)).to(device)
    expected.backward(dout.double())
    scores = q.double() @ k.double().transpose(-1, -2) * head_dim ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(n * seq_local, n * seq_local, dtype=torch.bool,
                                               device=device).triu(1), float("-inf"))
    rows = slice(rank * seq_local, (rank + 1) * seq_local)
    expected_lse = torch.logsumexp(scores, dim=-1)[..., rows]
    other_scales = {name: F.scaled_dot_product_attention(*(t.detach() for t in full), is_causal=causal,
                                                         scale=scale)[..., rows, :]
                    for name, scale in (("1/d", 1 / head_dim), ("1", 1.0))}

    if layout == "transposed":   # (b, s, h, d) storage seen as (b, h, s, d): not contiguous
        mine = [t[..., rows, :].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
                for t in (q, k, v)]
    else:
        mine = [t[..., rows, :].clone().requires_grad_(True) for t in (q, k, v)]
    rep = {"rank": rank, "size": n, "seq_local": seq_local, "causal": causal, "dtype": str(dtype),
           "kv_bytes": mine[1].nbytes + mine[2].nbytes, "q_bytes": mine[0].nbytes,
           "lse_bytes": expected_lse.nbytes, "backward_called": False}
    handed = {}
    original = lab.with_ring_backward

    def spy(q_, k_, v_, out_, lse_, *args, **kwargs):
        handed["lse"] = lse_.detach().double()
        return original(q_, k_, v_, out_, lse_, *args, **kwargs)

    lab.with_ring_backward = spy
    try:
        with count_p2p() as traffic, trace_ring() as trace, SavedTensorBytes() as saved:
            out = ring_attention(*mine, causal=causal, group=group)
    except Exception as err:
        return {**rep, "error": f"{type(err).__name__}: {err}"}
    finally:
        lab.with_ring_backward = original
    got = out.detach().double()
    rep.update(traffic=traffic.summary(), saved=saved.bytes, blocks=trace.blocks,
               max_live=trace.max_live_recv_bytes, live=trace.live_recv_bytes,
               into_sending=trace.received_into_sending,
               events=[(e.kind, e.k_start) for e in trace.events],
               shape_ok=tuple(out.shape) == tuple(mine[0].shape), out_dtype=str(out.dtype),
               output=(got - expected.detach()[..., rows, :]).abs().max().item()
               if got.shape == expected[..., rows, :].shape else float("inf"),
               output_scale=expected.detach()[..., rows, :].abs().max().item(),
               scaled_by=next((name for name, other in other_scales.items() if got.shape == other.shape
                               and (got - other).abs().max().item() < 1e-6), None),
               backward_called="lse" in handed,
               lse=(handed["lse"] - expected_lse).abs().max().item() if "lse" in handed else None)
    posted, waited = len(trace.of("recv")), len(trace.of("wait recv"))
    if waited < posted:     # its messages are still in flight: any later message could meet them
        rep["error"] = (f"UnwaitedReceive: ring_attention posted {posted} receive(s) and waited for {waited}: a "
                        "block is used (and the next one sent on) before it has arrived, and the messages left "
                        "in flight would meet the next ones. Wait for every request the exchange returns, after "
                        "computing the current block and before using the received one")
        return rep
    try:
        out.backward(dout[..., rows, :])
    except Exception as err:
        rep["backward_error"] = f"{type(err).__name__}: {err}"
        return rep
    for name, ours, ref in zip(("dq", "dk", "dv"), mine, full):
        rep[name] = float("inf") if ours.grad is None else \
            (ours.grad.double() - ref.grad[..., rows, :].double()).abs().max().item()
        rep[f"{name}_scale"] = ref.grad[..., rows, :].abs().max().item()
    return rep


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ring_attention is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=180, env={"DIST_TIMEOUT": "30"},
                        needs=[ring_attention])


STOPS = ("UnwaitedReceive",)     # errors after which a rank ends the launch: its messages are in flight


def case(results, name: str, ranks=range(NPROC)) -> list[dict]:
    """Every listed rank's report for one case; a case that raised fails here, with its error (and
    a launch that one rank ended, for an error in STOPS, gives that error)."""
    try:
        reps = [results[rank]["cases"][name] for rank in ranks]
    except RankFailure as err:
        stopped = [c for rank_report in results.partial.values() for c in rank_report.get("cases", {}).values()
                   if c.get("error", "").startswith(STOPS)]
        if stopped:
            pytest.fail(f"group rank {stopped[0]['rank']}: {stopped[0]['error']}")
        raise RankFailure(f"the launch failed before case {name!r} was reported: {err}") from None
    for rep in reps:
        if "error" in rep:
            hint = (" K and V must travel around the ring with isend/irecv: a collective such as "
                    "all_gather puts the whole sequence's K/V on every rank"
                    if rep["error"].startswith("CollectiveUsed") else
                    " On a sub-group, ranks, sizes and neighbours are the group's (dist.get_rank(group), "
                    "dist.get_world_size(group)); isend/irecv take global ranks (dist.get_global_rank, "
                    "or ring_peers(group))" if name == "subgroup" else
                    " q, k, v may be non-contiguous views: send contiguous copies (isend/irecv "
                    "need contiguous tensors)" if "contiguous" in rep["error"] else "")
            pytest.fail(f"group rank {rep['rank']} ({name}): ring_attention raised {rep['error']}.{hint}")
    return reps


MERGE = ("Each block's result is normalised over that block's keys only: merge them with their "
         "log-sum-exps (rescale the partial output so far when a block adds to the normaliser), as "
         "the online softmax does; averaging or adding blocks' softmaxes is not the softmax of the "
         "whole row.")
POSITIONS = ("With causal=True the query at global position i sees the keys at global positions "
             "j <= i: at step i rank r holds the block that started on rank (r - i) mod N (blocks move "
             "to the next rank); rank r's queries start at r * seq_local, the block from rank j "
             "starts at j * seq_local, and blocks from later ranks are all in the future.")


def failing_first(results, *names: str, fields=("output",)) -> str:
    """The first of the basic cases `names` with a wrong `fields` (output, dq, dk, dv) on some
    rank, or "": a test of a later property then says to fix that one first instead of blaming
    its own property."""
    for name in names:
        for rank in range(NPROC):
            rep = results[rank]["cases"][name]
            if "error" in rep or not all(rep.get(field, float("inf")) < TOL for field in fields):
                return name
    return ""


SCALE = ("It equals softmax(Q K^T * {scale}) V instead: attention scales the scores by 1/sqrt(d) "
         "(head_dim d), which attention_block applies when you do not pass a scale.")
INTO_SENDING = ("It received the next block into the tensor it was still sending: the incoming "
                "block overwrites the outgoing one while the send reads it, so the next rank may get "
                "this rank's new block instead of the one it needs, and this rank computes with a "
                "block that is being replaced. Receive into a buffer of its own (e.g. "
                "torch.empty_like of the block) and send the current block unchanged until its send "
                "has been waited for.")


def forward_message(results, rep: dict, name: str) -> str:
    what = (f"group rank {rep['rank']} ({name}): the output differs from SDPA on the whole "
            f"sequence by {rep['output']:.2e}. ")
    if rep.get("into_sending"):
        return what + INTO_SENDING
    if rep.get("scaled_by"):
        return what + SCALE.format(scale=rep["scaled_by"])
    if rep["causal"] and not failing_first(results, "full"):
        return what + POSITIONS
    return what + MERGE + ("" if not rep["causal"] else " (The non-causal case fails too.)")


def fix_first(results, *names: str, fields=("output",)) -> str:
    """" First make the '<name>' case pass (its own test says what is wrong)", or ""."""
    failing = failing_first(results, *names, fields=fields)
    return f" First make the {failing!r} case pass: its own test says what is wrong there." if failing else ""


# ----------------------------------------------------------------------------------------- tests
def test_matches_sdpa_without_mask(results):
    """Non-causal: every rank's output equals SDPA's on the whole sequence (its rows)."""
    for rep in case(results, "full"):
        assert rep["shape_ok"], f"group rank {rep['rank']}: return a (batch, heads, seq_local, head_dim) tensor"
        assert rep["output"] < TOL, forward_message(results, rep, "full")


def test_matches_sdpa_causal(results):
    """Causal: the mask compares global positions; every rank's rows equal SDPA's."""
    for rep in case(results, "causal"):
        assert rep["output"] < TOL, forward_message(results, rep, "causal")


@pytest.mark.parametrize("name", ["large scores", "large scores causal"])
def test_merge_survives_scores_in_the_hundreds(results, name):
    """Scores of several hundred (exp overflows float64 past 709): the merge stays exact."""
    for rep in case(results, name):
        assert rep["output"] < TOL, (
            f"group rank {rep['rank']} ({name}): output off by {rep['output']:.2e} when scores reach "
            "the hundreds." + (fix_first(results, "full", "causal") or
                               " exp(score) overflows there (inf / inf = nan): merge the blocks "
                               "relative to the running maximum, i.e. with log-sum-exps "
                               "(torch.logaddexp, exp(lse_old - lse_new)), never with raw exp(lse) "
                               "weights"))


@pytest.mark.parametrize("name", ["full", "causal", "transposed views"])
def test_gradients_match_sdpa(results, name):
    """Autograd through the result gives SDPA's dq, dk and dv on every rank."""
    for rep in case(results, name):
        assert "backward_error" not in rep, (
            f"group rank {rep['rank']} ({name}): backward raised {rep.get('backward_error')}. " +
            ("with_ring_backward was called, but with tensors cut off from autograd: pass it this rank's own "
             "q, k and v (not detached copies), so the gradients reach them" if rep["backward_called"] else
             "Return with_ring_backward(q, k, v, out, lse, causal, group): it makes the result differentiable"))
        assert rep["backward_called"], (
            f"group rank {rep['rank']} ({name}): with_ring_backward was not called. Autograd cannot "
            "follow K and V through isend/irecv, so the other ranks' dK/dV would be lost: return "
            "with_ring_backward(q, k, v, out, lse, causal, group), whose backward is the second ring")
        for grad in ("dq", "dk", "dv"):
            assert rep[grad] < TOL, (
                f"group rank {rep['rank']} ({name}): {grad} differs from SDPA's by {rep[grad]:.2e}." +
                (fix_first(results, name, "full", "causal") or
                 " Pass with_ring_backward this rank's own q, k, v (not detached copies), the merged "
                 "output and its log-sum-exp over the whole sequence"))


@pytest.mark.parametrize("name", ["full", "causal"])
def test_lse_handed_to_the_backward_is_the_whole_rows(results, name):
    """The lse given to with_ring_backward is each query's log-sum-exp over the whole sequence."""
    for rep in case(results, name):
        assert rep["backward_called"], f"group rank {rep['rank']} ({name}): with_ring_backward was not called"
        assert rep["lse"] < TOL, (
            f"group rank {rep['rank']} ({name}): lse differs by {rep['lse']:.2e} from log sum_j "
            "exp(q_i k_j / sqrt(d)) over every visible key of the sequence: the backward rebuilds each "
            "block's softmax as exp(scores - lse), so it needs the merged one, not the last block's")


@pytest.mark.parametrize("name", ["full", "causal"])
def test_blocks_at_global_positions_and_future_blocks_skipped(results, name):
    """attention_block gets global positions; causal skips the blocks of later ranks, computes the rest once."""
    for rep in case(results, name):
        r, n, s = rep["rank"], rep["size"], rep["seq_local"]
        wrong_q = sorted({q for q, _, _, _ in rep["blocks"] if q != r * s})
        assert not wrong_q, (
            f"group rank {r} ({name}) called attention_block with q_start {wrong_q}: positions are "
            f"global, this rank's queries start at {r} * seq_local = {r * s}")
        sources = sorted(k // s for _, _, k, _ in rep["blocks"])
        expected = list(range(r + 1)) if rep["causal"] else list(range(n))
        later = sorted({j for j in sources if j > r})
        if rep["causal"] and later:
            pytest.fail(f"group rank {r} ({name}) computed the blocks of ranks {later}, whose keys all "
                        "come after its queries: with causal=True they add nothing, skip them")
        assert sources == expected, (
            f"group rank {r} ({name}) computed blocks with k_start {[j * s for j in sources]}; "
            f"expected each of {[j * s for j in expected]} once (k_start: the global position of "
            "the block's first key, j * seq_local for rank j's block)")


@pytest.mark.parametrize("name", list(CASES))
def test_only_point_to_point_to_the_ring_neighbours(results, name):
    """Messages go only to the next rank and come only from the previous one: N-1 K/V blocks each way."""
    for rep in case(results, name):
        r, n, t = rep["rank"], rep["size"], rep["traffic"]
        assert set(t["send_peers"]) <= {(r + 1) % n}, (
            f"group rank {r} sent to {t['send_peers']}: in a ring each rank sends only to the next "
            f"one, {(r + 1) % n} (passing on the block it received)")
        assert set(t["recv_peers"]) <= {(r - 1) % n}, (
            f"group rank {r} received from {t['recv_peers']}: only from the previous rank, {(r - 1) % n}")
        expected = (n - 1) * rep["kv_bytes"]
        assert t["sent_bytes"] == expected and t["recv_bytes"] == expected, (
            f"group rank {r} ({name}) sent {t['sent_bytes']} and received {t['recv_bytes']} bytes; the "
            f"ring moves N-1 = {n - 1} blocks of K and V ({rep['kv_bytes']} bytes each) each way")


def overlap_violation(rep: dict) -> str:
    """What breaks the overlap, from the order of events ("" if nothing). The c-th block computed
    (0-based; with causal=True a rank computes at steps 0, 1, ... too) must find the receive of
    the next block posted, and, when waits are seen, not yet waited for; a receive made of several
    messages (K and V apart) counts as m posts."""
    n = rep["size"]
    if n == 1:
        return ""
    recvs = sum(1 for kind, _ in rep["events"] if kind == "recv")
    per_step = recvs // (n - 1) if recvs and recvs % (n - 1) == 0 else 1
    waits_seen = any(kind == "wait recv" for kind, _ in rep["events"])
    posted = waited = computed = 0
    for kind, _ in rep["events"]:
        posted += kind == "recv"
        waited += kind == "wait recv"
        if kind != "block":
            continue
        if posted < min(computed + 1, n - 1) * per_step:
            return (f"computed its block number {computed} (0-based) before posting the receive of the "
                    "next block: post it (isend/irecv or batch_isend_irecv, which return at once) "
                    "before computing, so the transfer runs during the compute; a blocking send/recv "
                    "after the compute leaves the link idle while computing and the CPU idle while "
                    "sending")
        if waits_seen and computed < n - 1 and waited > computed * per_step:
            return (f"waited for the next block before computing its block number {computed} "
                    "(0-based): wait after the compute, or nothing overlaps")
        computed += 1
    return ""


@pytest.mark.parametrize("name", ["full", "causal"])
def test_next_block_received_while_this_one_is_computed(results, name):
    """The receive of the next block is posted before the current block's compute, waited for after it."""
    for rep in case(results, name):
        problem = overlap_violation(rep)
        assert not problem, f"group rank {rep['rank']} ({name}) {problem}"


def test_no_rank_holds_more_than_two_received_blocks(results):
    """Received K/V buffers alive during any block's compute: at most two blocks (current and incoming)."""
    for rep in case(results, "long blocks"):
        worst = max(range(len(rep["live"])), key=lambda i: rep["live"][i], default=0)
        if rep["max_live"] > 2 * rep["kv_bytes"] and rep["saved"] > 4 * rep["q_bytes"] + rep["lse_bytes"]:
            pytest.fail(f"group rank {rep['rank']} kept {rep['max_live'] / rep['kv_bytes']:g} received K/V blocks "
                        f"alive at its block number {worst}: autograd keeps them, because the forward ran with "
                        f"autograd on ({rep['saved']} bytes saved for the backward, where q, k, v, out and lse "
                        "take less). Compute the forward under torch.no_grad(): with_ring_backward "
                        "recomputes each block in the backward")
        assert rep["max_live"] <= 2 * rep["kv_bytes"], (
            f"group rank {rep['rank']} kept {rep['max_live']} bytes of received K/V alive while "
            f"computing its block number {worst} (0-based): {rep['max_live'] / rep['kv_bytes']:g} blocks "
            f"of {rep['kv_bytes']} bytes, where a ring needs two (the one computed and the one "
            f"arriving). Keeping every received block (a list of them, or a reference to each) is "
            f"an all-gather's memory, N - 1 = {rep['size'] - 1} blocks here: let each block go once "
            "it has been computed and passed on")


def test_receives_into_a_buffer_of_its_own(results):
    """No receive lands in a tensor whose send is still in flight."""
    for name in ("full", "causal"):
        for rep in case(results, name):
            assert not rep["into_sending"], f"group rank {rep['rank']} ({name}): {INTO_SENDING}"


def test_bfloat16_within_torchs_tolerances(results):
    """bf16 as torch tests its ring: output and gradients within 1e-3 N and 8e-3 N of SDPA in float64."""
    from labs.lab11_ring_attention import bf16_tolerance

    first = failing_first(results, "full", "causal", fields=("output", "dq", "dk", "dv"))
    for rep in case(results, "bfloat16"):
        assert rep["out_dtype"] == "torch.bfloat16", (
            f"group rank {rep['rank']}: bf16 inputs gave a {rep['out_dtype']} output: with_ring_backward "
            "casts the merged output back to q's dtype; return what it returns")
        for quantity in ("output", "dq", "dk", "dv"):
            atol = bf16_tolerance(quantity, rep["size"])
            scale = rep["output_scale" if quantity == "output" else f"{quantity}_scale"]
            assert rep[quantity] <= atol + 1e-5 * scale, (
                f"group rank {rep['rank']} (bfloat16): {quantity} differs from SDPA in float64 by "
                f"{rep[quantity]:.2e}, beyond torch's own tolerance for its ring on {rep['size']} ranks "
                f"({atol:.1e})." + (f" First make the {first!r} case pass." if first else
                                    " bf16 keeps 8 bits of mantissa: keep the running output and "
                                    "log-sum-exp in the dtype attention_block returns them in (float32 "
                                    "for bf16 inputs) and let with_ring_backward cast the result back "
                                    "once, at the end; a running output stored in bf16 loses what each "
                                    "later block adds"))


def test_nothing_sequence_squared_kept_for_backward(results):
    """What autograd keeps from the forward: q, k, v, the output and lse, nothing seq_local^2 sized."""
    for rep in case(results, "long blocks"):
        budget = 4 * rep["q_bytes"] + rep["lse_bytes"]
        assert rep["saved"] <= budget, (
            f"group rank {rep['rank']}: the forward kept {rep['saved']} bytes for backward, more than "
            f"q, k, v, out and lse ({budget}): autograd recorded the blocks' score matrices. Compute "
            "the forward under torch.no_grad(); with_ring_backward recomputes each block in backward")


def test_inputs_that_are_transposed_views(results):
    """q, k, v given as non-contiguous views (after a transpose) work like contiguous ones."""
    for rep in case(results, "transposed views"):
        assert rep["output"] < TOL, (
            f"group rank {rep['rank']}: with q, k, v non-contiguous views the output is off by "
            f"{rep['output']:.2e}." + (fix_first(results, "causal") or
                                       " Contiguous inputs work: do not rely on the memory layout "
                                       "(isend needs contiguous tensors: send a contiguous copy)"))


def test_on_a_subgroup(results):
    """Ranks 1-3 run a ring over a group of their own while rank 0 runs alone: group ranks and sizes."""
    trio, solo = SUBGROUPS
    for members in (trio, solo):
        for rep in case(results, "subgroup", ranks=members):
            assert rep["output"] < TOL and rep["dk"] < TOL, (
                f"on the group {members}, group rank {rep['rank']}: off by {rep['output']:.2e} "
                f"(dk {rep['dk']:.2e})." + (fix_first(results, "full", "causal", fields=("output", "dk")) or
                                           " Use the group's rank and size (dist.get_rank(group), "
                                           "dist.get_world_size(group)) for positions and neighbours, "
                                           "and global ranks (dist.get_global_rank, or "
                                           "ring_peers(group)) for isend/irecv"))
    assert case(results, "subgroup", ranks=solo)[0]["traffic"]["sends"] == 0, "a group of one sends nothing"


def test_one_rank_is_plain_attention():
    """World size 1, in this process: SDPA's result and gradients, and no message sent."""
    from helpers.dist import distributed

    with distributed() as ctx:
        rep = run_case(2, 2, 5, 4, True, 1.0, "contiguous", device=ctx.device)
    assert "error" not in rep, f"ring_attention raised {rep.get('error')} on one rank"
    assert rep["output"] < TOL and rep["dq"] < TOL and rep["dk"] < TOL, (
        f"one rank: off by {rep['output']:.2e} (dq {rep['dq']:.2e}, dk {rep['dk']:.2e})")
    assert rep["traffic"]["sends"] == rep["traffic"]["recvs"] == 0, "with one rank nothing is sent"


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    from helpers.dist import distributed, new_group

    with distributed() as ctx:
        cases = {}
        for name, args in [*CASES.items(), ("bfloat16", BF16)]:
            cases[name] = run_case(*args, device=ctx.device, **({"seed": 10, "dtype": torch.bfloat16}
                                                                if name == "bfloat16" else {}))
            if cases[name].get("error", "").startswith(STOPS):
                ctx.report(cases=cases)
                raise SystemExit(cases[name]["error"])   # messages in flight: nothing after this is sound
        groups = [new_group(members, name=f"ring of {members}") for members in SUBGROUPS]   # every rank, every group
        mine = next(g for g, members in zip(groups, SUBGROUPS) if ctx.rank in members)
        cases["subgroup"] = run_case(1, 2, 4, 4, True, 1.0, "contiguous", group=mine, seed=3,
                                     device=ctx.device)
        ctx.report(cases=cases)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
