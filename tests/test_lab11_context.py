"""Tests of lab 11's context-parallel labs beyond the exercise: the block kernel and its backward,
the merge, the layouts and the ring's schedule on paper, the backward ring (fed the reference
forward, so it is tested without the homework), the zig-zag ring, Ulysses, torch's ring and
context_parallel, the memory formulas, and every lab's run() end to end in smoke mode. Parts that
need the homework `ring_attention` go through `solved(...)`: while it is the stub they read
"not implemented yet".

Run:  .venv/bin/python -m pytest tests/test_lab11_context.py -q

One launch on 2 ranks (this file is its worker); everything else in this process.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import labs.lab11_attention_memory as memory
import labs.lab11_ring_attention as lab
import labs.lab11_ulysses as ulysses
import labs.lab11_zigzag as zigzag
from helpers.notice import solved
from tests.harness import launch_ranks

NPROC = 2
TOL = 1e-12          # float64, one process: rounding only


def qkv(b=2, h=3, s=12, d=4, seed=0):
    return lab.sample_qkv(b, h, s, d, seed=seed)


def reference(q, k, v, causal):
    """SDPA's output, the whole rows' lse, and its gradients for a fixed dout."""
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype).to(out.device)
    out.backward(dout)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = q.shape[-2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return out.detach(), torch.logsumexp(scores, -1), dout, [t.grad for t in full]


# ---------------------------------------------------------------------------------- block kernel
@pytest.mark.parametrize("causal", [False, True])
def test_one_block_is_sdpa(causal):
    q, k, v = qkv()
    out, lse = lab.attention_block(q, k, v, 0, 0, causal)
    expected, expected_lse, _, _ = reference(q, k, v, causal)
    assert (out - expected).abs().max() < TOL and (lse - expected_lse).abs().max() < TOL


def test_blocks_at_global_positions_merge_into_the_whole_rows():
    """Queries 4..7 against key blocks 0..3, 4..7, 8..11 (the last all in the future): merged, the
    rows of causal SDPA; the future block gives out 0, lse -inf and does not disturb the merge."""
    q, k, v = qkv()
    expected, expected_lse, _, _ = reference(q, k, v, True)
    parts = [lab.attention_block(q[..., 4:8, :], k[..., j:j + 4, :], v[..., j:j + 4, :], 4, j, True)
             for j in (0, 4, 8)]
    future_out, future_lse = parts[2]
    assert torch.equal(future_out, torch.zeros_like(future_out)) and torch.isinf(future_lse).all()
    out, lse = lab.combine_partials(*zip(*parts))
    assert (out - expected[..., 4:8, :]).abs().max() < TOL
    assert (lse - expected_lse[..., 4:8]).abs().max() < TOL


def test_local_positions_give_another_answer():
    """The same block with local positions (0, 0) masks what global positions keep: the kernel
    really reads its positions (so a test on them can fail)."""
    q, k, v = qkv()
    right, _ = lab.attention_block(q[..., 4:8, :], k[..., 0:4, :], v[..., 0:4, :], 4, 0, True)
    wrong, _ = lab.attention_block(q[..., 4:8, :], k[..., 0:4, :], v[..., 0:4, :], 0, 0, True)
    assert (right - wrong).abs().max() > 1e-3


def test_combine_survives_huge_scores():
    q, k, v = lab.sample_qkv(1, 2, 8, 4, logit_scale=300.0)
    expected, _, _, _ = reference(q, k, v, False)
    out, _ = lab.combine_partials(*zip(*[lab.attention_block(q, k[..., j:j + 2, :], v[..., j:j + 2, :], 0, j, False)
                                         for j in range(0, 8, 2)]))
    assert torch.isfinite(out).all() and (out - expected).abs().max() < 1e-10


@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_sums_to_sdpa_gradients(causal):
    """attention_block_backward over 3 x 3 blocks, given the whole rows' lse and delta, adds up to
    SDPA's dq, dk, dv."""
    q, k, v = qkv()
    out, lse, dout, grads = reference(q, k, v, causal)
    delta = (dout * out).sum(-1)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    for i in range(0, 12, 4):
        for j in range(0, 12, 4):
            a, b, c = lab.attention_block_backward(q[..., i:i + 4, :], k[..., j:j + 4, :], v[..., j:j + 4, :],
                                                   dout[..., i:i + 4, :], lse[..., i:i + 4],
                                                   delta[..., i:i + 4], i, j, causal)
            dq[..., i:i + 4, :] += a
            dk[..., j:j + 4, :] += b
            dv[..., j:j + 4, :] += c
    for got, want in zip((dq, dk, dv), grads):
        assert (got - want).abs().max() < 1e-11


# ---------------------------------------------------------------------------------- layouts
def test_local_chunks():
    assert lab.local_chunks("contiguous", 2, 4, 6) == [(0, 12, 6)]
    assert lab.local_chunks("zigzag", 1, 4, 6) == [(0, 3, 3), (3, 18, 3)]
    with pytest.raises(ValueError, match="a zig-zag shard into its two chunks: 5 is not divisible by 2"):
        lab.local_chunks("zigzag", 0, 2, 5)
    with pytest.raises(ValueError, match="layout must be one of"):
        lab.local_chunks("striped", 0, 2, 4)


def test_block_pairs_kinds():
    kinds = lambda layout, r, src: [p.kind for p in lab.block_pairs(layout, r, src, 2, 4, True)]  # noqa: E731
    assert kinds("contiguous", 0, 0) == ["diagonal"] and kinds("contiguous", 0, 1) == ["skipped"]
    assert kinds("contiguous", 1, 0) == ["full"]
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of 4)
    assert kinds("zigzag", 0, 0) == ["diagonal", "skipped", "full", "diagonal"]
    assert kinds("zigzag", 0, 1) == ["skipped", "skipped", "full", "full"]
    assert kinds("zigzag", 1, 0) == ["full", "skipped", "full", "skipped"]
    assert all(p.kind == "full" for p in lab.block_pairs("zigzag", 1, 0, 2, 4, False))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", lab.LAYOUTS)
def test_schedule_covers_the_causal_triangle_once(layout, n):
    """Over every step and rank, each tile on or below the diagonal is computed exactly once and
    none above it: the schedule is causal attention, split."""
    covered = {}
    for row in zigzag.ring_schedule(n, layout):
        assert row["holds"] == (row["rank"] - row["step"]) % n
        for q0, ql, k0, kl, kind in row["computes"]:
            for qc in range(q0, q0 + ql):
                for kc in range(k0, k0 + kl):
                    covered[qc, kc] = covered.get((qc, kc), 0) + 1
    lower = {(qc, kc) for qc in range(2 * n) for kc in range(qc + 1)}
    above = {t for t in covered if t not in lower}
    assert lower <= set(covered), f"tiles never computed: {sorted(lower - set(covered))}"
    assert all(count == 1 for count in covered.values()), "a tile computed twice"
    if layout == "zigzag":
        assert not above, f"zig-zag computes tiles above the diagonal: {sorted(above)}"
    else:
        assert above == {(2 * r, 2 * r + 1) for r in range(n)}   # the upper half of each diagonal block


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_zigzag_balances_the_work(n):
    assert zigzag.work_per_rank(zigzag.ring_schedule(n, "contiguous")) == [4 * (r + 1) for r in range(n)]
    assert zigzag.work_per_rank(zigzag.ring_schedule(n, "zigzag")) == [2 * n + 1] * n
    assert zigzag.work_per_rank(zigzag.ring_schedule(n, "zigzag", causal=False)) == [4 * n] * n


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_is_torchs_head_tail_layout(n):
    theirs = zigzag.torch_head_tail_positions(4 * n, n)
    if isinstance(theirs, str):
        pytest.skip(theirs)
    assert zigzag.zigzag_positions(4 * n, n) == theirs


def test_sequence_shard_zigzag_round_trip():
    x = torch.arange(16.0).view(1, 1, 16, 1)
    shards = [lab.sequence_shard(x, r, 2, "zigzag").flatten().tolist() for r in range(2)]
    assert shards == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [int(p) for p in sum(shards, [])] == sum(zigzag.zigzag_positions(16, 2), [])


# ---------------------------------------------------------------------------------- formulas
def test_bytes_formulas():
    b, h, s, d = 1, 4, 16, 8
    x = b * h * (s // 4) * d
    assert ulysses.bytes_per_rank("ulysses", 4, b, h, s, d, 8) == {"forward": 4 * x * 8 * 3 // 4,
                                                                   "backward": 4 * x * 8 * 3 // 4}
    assert ulysses.bytes_per_rank("ring", 4, b, h, s, d, 8) == {"forward": 2 * x * 8 * 3,
                                                                "backward": 2 * x * 8 * 3 + 2 * x * 8 * 4}
    assert ulysses.bytes_per_rank("ring", 1, b, h, s, d, 8) == {"forward": 0, "backward": 0}
    with pytest.raises(ValueError, match="kind must be"):
        ulysses.bytes_per_rank("tree", 2, b, h, s, d, 8)
    rows = ulysses.formula_rows()
    assert [r["ring / Ulysses"] for r in rows] == [n / 2 for n in (2, 4, 8, 16, 32, 64)]
    assert [r["Ulysses possible"] for r in rows] == [True] * 5 + [False]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [8, 24])
def test_plain_attention_saves_what_the_formula_says(seq, causal):
    q, k, v = (t.float().requires_grad_(True) for t in lab.sample_qkv(2, 3, seq, 4))
    assert (memory.plain_attention(q, k, v, causal) - F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ).abs().max() < 1e-5
    assert memory.saved_bytes(memory.plain_attention, q, k, v, causal) == \
        memory.plain_attention_saved_bytes(seq, 2, 3, 4, 4, causal)


def test_korthikanti_term():
    assert memory.korthikanti_attention_bytes(1024, 2, 16) == 5 * 16 * 1024 ** 2 * 2
    assert memory.korthikanti_attention_bytes(1024, 2, 16, tp=4) == 5 * 16 * 1024 ** 2 * 2 / 4
    assert memory.korthikanti_attention_bytes(512, 1, 8, element_bytes=4, dropout=False) == 8 * 512 ** 2 * 4
    assert memory.plain_attention_saved_bytes(512, 1, 8, 16, 4, tp=2) == \
        3 * 512 * 4 * 16 * 4 + 4 * 512 ** 2 * 4


# ---------------------------------------------------------------------------------- on 2 ranks
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, nproc=NPROC, env={"COURSE_SMOKE": "1", "DIST_TIMEOUT": "30"})


def test_backward_ring_gives_sdpa_gradients(ranks):
    """with_ring_backward fed the reference output and lse: dq, dk, dv equal SDPA's, both layouts."""
    for rank in range(NPROC):
        for name, diff in ranks[rank]["backward"].items():
            assert diff["worst"] < 1e-10, (rank, name, diff)


def test_backward_ring_traffic(ranks):
    """The backward sends N-1 K/V blocks and N accumulators, to the next rank only; no collective."""
    for rank in range(NPROC):
        for name, t in ranks[rank]["backward_traffic"].items():
            assert t["send_peers"] == [(rank + 1) % NPROC] and t["recv_peers"] == [(rank - 1) % NPROC]
            assert t["sent_bytes"] == t["expected"], (rank, name, t)


def test_zigzag_ring_matches_sdpa_and_its_schedule(ranks):
    for rank in range(NPROC):
        rep = ranks[rank]["zigzag"]
        assert rep["diff"]["worst"] < 1e-10, rep["diff"]
        assert rep["blocks"] == rep["schedule_blocks"]
        assert rep["traffic"]["sent_bytes"] == (NPROC - 1) * rep["kv_bytes"]


def test_ulysses(ranks):
    for rank in range(NPROC):
        rep = ranks[rank]["ulysses"]
        assert rep["diff"]["worst"] < 1e-12, rep["diff"]
        assert rep["bytes"]["counted"] == rep["bytes"]["formula"]
        assert rep["heads_error"] == ("attention heads over the sequence-parallel ranks (Ulysses gives each "
                                      "rank whole heads): 3 is not divisible by 2")


def test_torch_ring_and_context_parallel(ranks):
    """torch's ring (both layouts, both rotate methods) matches SDPA and sends what ours sends;
    context_parallel itself fails on the CPU with the error the lab records."""
    for rank in range(NPROC):
        rep = ranks[rank]["labs"]["lab11_context_parallel"]
        cp = rep["context_parallel"]
        if cp["device"] == "cpu":
            assert not cp["ran"] and "_scaled_dot_product_flash_attention_for_cpu" in cp["error"], cp
        rows = rep["torch_ring"]["rows"]
        assert {(r["implementation"], r["layout"]) for r in rows} == {
            (impl, layout) for impl in ("torch, allgather", "torch, alltoall", "ours") for layout in lab.LAYOUTS}
        for row in rows:
            if row["implementation"] != "ours" or row["layout"] == "zigzag":
                assert max(row[k] for k in ("output", "dq", "dk", "dv")) < 1e-10, row
        torch_bytes = {r["layout"]: r["sent_bytes"] for r in rows if r["implementation"] == "torch, alltoall"}
        zz = next(r for r in rows if r["implementation"] == "ours" and r["layout"] == "zigzag")
        assert zz["sent_bytes"] == torch_bytes["zigzag"]


def test_labs_run_end_to_end(ranks):
    """Every lab's run() in smoke mode; the homework's parts through solved()."""
    for rank in range(NPROC):
        labs_ = ranks[rank]["labs"]
        ring = solved(labs_["lab11_ring_attention"]["check"])
        assert max(c["max_abs_diff"]["worst"] for c in ring.values()) < 1e-10
        assert len(ring["causal"]["blocks"]) == rank + 1 and len(ring["full"]["blocks"]) == NPROC
        zz = labs_["lab11_zigzag"]
        assert max(c["worst"] for c in zz["zigzag_vs_sdpa"].values()) < 1e-10
        tile = (zz["sizes"]["seq_local"] // 2) ** 2
        assert zz["balance"]["zigzag"]["work"] == zz["predicted_tiles"]["zigzag"][rank] * tile
        assert solved(zz["balance"]["contiguous"])["work"] == zz["predicted_tiles"]["contiguous"][rank] * tile
        assert zz["positions"] == zz["torch_positions"]
        ul = labs_["lab11_ulysses"]
        assert max(c["worst"] for c in ul["ulysses_vs_sdpa"].values()) < 1e-12
        for kind in ("ulysses", "ring"):
            measured = solved(ul["bytes"][kind])
            assert measured["counted"] == measured["formula"], (kind, measured)
        mem = labs_["lab11_attention_memory"]
        ring_rows = solved(mem["ring"])
        assert [r["seq"] for r in ring_rows] == mem["sizes"]["seqs"]
        for row in ring_rows:   # linear in s: q, k, v, out, lse of this rank's positions
            b, a, d, n = mem["sizes"]["batch"], mem["sizes"]["heads"], mem["sizes"]["head_dim"], NPROC
            assert row["saved"] == 4 * b * a * (row["seq"] // n) * d * 4 + b * a * (row["seq"] // n) * 4
        if rank == 0:
            for row in mem["single"]:
                assert row["saved (measured)"] == row["saved (formula)"]
                assert row["plain peak backward"] > 2 * row["attention matrix a s^2 b e"]


def test_memory_grows_with_the_square_plain_and_not_fused(ranks):
    """Plain attention's saved bytes grow about 4x when s doubles (the s^2 term dominates);
    the fused kernel's grow about 2x (linear)."""
    rows = ranks[0]["labs"]["lab11_attention_memory"]["single"]
    (small, big) = rows[0], rows[-1]
    growth = big["seq"] / small["seq"]
    assert big["saved (measured)"] / small["saved (measured)"] > 1.4 * growth
    assert big["fused saved"] / small["fused saved"] <= 1.05 * growth


# ---------------------------------------------------------------------------------- the worker
def worker(ctx) -> dict:
    import importlib

    import torch.distributed as dist
    from helpers.comm_count import count_p2p

    rank, n = ctx.rank, ctx.world_size
    out = {"backward": {}, "backward_traffic": {}}
    q, k, v = lab.sample_qkv(2, 2, 8 * n, 4, seed=3, device=ctx.device)
    for layout in lab.LAYOUTS:
        for causal in (False, True):
            expected, lse, dout, grads = reference(q, k, v, causal)
            mine = [lab.sequence_shard(t, rank, n, layout).requires_grad_(True) for t in (q, k, v)]
            result = lab.with_ring_backward(*mine, lab.sequence_shard(expected, rank, n, layout),
                                            lab.sequence_shard(lse.unsqueeze(-1), rank, n, layout)[..., 0],
                                            causal, None, layout)
            with count_p2p() as traffic:
                result.backward(lab.sequence_shard(dout, rank, n, layout))
            name = f"{layout} {'causal' if causal else 'full'}"
            out["backward"][name] = {g: (t.grad - lab.sequence_shard(ref, rank, n, layout)).abs().max().item()
                                     for g, t, ref in zip(("dq", "dk", "dv"), mine, grads)}
            out["backward"][name]["worst"] = max(out["backward"][name].values())
            kv_bytes = mine[1].nbytes + mine[2].nbytes
            out["backward_traffic"][name] = {**traffic.summary(), "expected": (n - 1) * kv_bytes + n * kv_bytes}

    mine = [lab.sequence_shard(t, rank, n, "zigzag") for t in (q, k, v)]
    with count_p2p() as traffic, lab.trace_ring() as trace:
        zigzag.zigzag_ring_attention(*mine, causal=True)
    schedule = [c for row in zigzag.ring_schedule(n, "zigzag") if row["rank"] == rank for c in row["computes"]]
    chunk = q.shape[-2] // (2 * n)
    out["zigzag"] = {"diff": lab.compare_with_sdpa(lambda *t: zigzag.zigzag_ring_attention(*t, causal=True),
                                                   q, k, v, True, layout="zigzag"),
                     "blocks": sorted([x // chunk for x in block] for block in trace.blocks),
                     "schedule_blocks": sorted([c[0], c[1], c[2], c[3]] for c in schedule),
                     "traffic": traffic.summary(), "kv_bytes": mine[1].nbytes + mine[2].nbytes}

    qh, kh, vh = lab.sample_qkv(1, 4, 4 * n, 4, seed=4, device=ctx.device)
    try:
        ulysses.ulysses_attention(*(lab.sequence_shard(t, rank, n)[:, :3] for t in (qh, kh, vh)))
        heads_error = "no error"
    except ValueError as err:
        heads_error = str(err)
    out["ulysses"] = {"diff": lab.compare_with_sdpa(lambda *t: ulysses.ulysses_attention(*t, causal=True),
                                                    qh, kh, vh, True),
                      "bytes": ulysses.measure_bytes(ctx.device, dict(batch=1, heads=4, seq_local=4, head_dim=4),
                                                     "ulysses"),
                      "heads_error": heads_error}
    dist.barrier()
    out["labs"] = {}
    for name in ("lab11_ring_attention", "lab11_zigzag", "lab11_ulysses", "lab11_context_parallel",
                 "lab11_attention_memory"):
        out["labs"][name] = importlib.import_module(f"labs.{name}").run(ctx)
    return out


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker(ctx))
