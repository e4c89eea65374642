"""Tests of lab 05's non-exercise parts: sizes and shards, the byte counting and its formulas, the
comm-vs-compute model, the attention layout, construction errors, and the three labs run end to
end on 2 ranks in smoke mode (against dense, against DTensor's parallelize_module, and the
Transformer block). The 2-rank part needs the exercises solved (it runs backward passes).

Run:  .venv/bin/python -m pytest tests/test_lab05_tensor_parallel.py -q
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labs.lab05_tensor_parallel as lab
import labs.lab05_tp_comm_volume as comm
from helpers.launch import launch

NPROC = 2
TOL64 = 1e-9   # float64: only summation order differs

# ----------------------------------------------------------------------------------------------
# In-process: pure functions
# ----------------------------------------------------------------------------------------------


def test_divide():
    assert lab.divide(12, 3, "x") == 4
    with pytest.raises(ValueError, match=r"d_ff = 10 is not divisible by the tensor-parallel world size 3"):
        lab.divide(10, 3, "d_ff")


def test_shard_is_contiguous_chunk_r():
    t = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(torch.cat([lab.shard(t, 1, r, 3) for r in range(3)], dim=1), t)
    assert torch.equal(lab.shard(t, 0, 1, 2), t[2:4])
    with pytest.raises(ValueError):
        lab.shard(t, 1, 0, 4)


def test_ring_bytes_sent():
    assert lab.ring_bytes_sent("all_reduce", 1000, 2) == 1000      # 2 (N-1)/N K
    assert lab.ring_bytes_sent("all_reduce", 1000, 4) == 1500
    assert lab.ring_bytes_sent("all_gather", 1000, 4) == 750       # (N-1)/N K


def test_formula_counts_per_scheme():
    T, d, ff = 10, 4, 16
    assert comm.mlp_collectives_formula("megatron", T, d, ff) == [
        ("forward", "all_reduce", T * d), ("backward", "all_reduce", T * d)]
    ag = comm.mlp_collectives_formula("allgather", T, d, ff)
    assert [n for *_, n in ag] == [T * ff, T * d, T * ff, T * d]
    with pytest.raises(ValueError, match="unknown scheme"):
        comm.mlp_collectives_formula("ring", T, d, ff)


def test_comm_rows_put_count_beside_formula():
    T, d, ff, N, b = 8, 4, 16, 4, 4
    calls = [lab.Collective(op, phase, (T, n // T), n * b, N)
             for phase, op, n in comm.mlp_collectives_formula("allgather", T, d, ff)]
    rows = comm.comm_rows("allgather", calls, T, d, ff, N, b)
    assert [r["phase"] for r in rows] == ["forward", "backward"]
    fwd, bwd = rows
    assert fwd["collectives"] == "all_gather + all_gather"
    assert math.isclose(fwd["sent/rank MB (counted)"], 0.75 * T * (ff + d) * b / 1e6)
    assert math.isclose(bwd["sent/rank MB (counted)"], 1.5 * T * (ff + d) * b / 1e6)
    for r in rows:
        assert math.isclose(r["sent/rank MB (counted)"], r["sent/rank MB (formula)"])
    # a missing collective shows up as a mismatch
    short = comm.comm_rows("allgather", calls[:-1], T, d, ff, N, b)
    assert short[1]["sent/rank MB (counted)"] < short[1]["sent/rank MB (formula)"]


def test_comm_vs_compute_model():
    m = comm.comm_vs_compute_model(tokens=1000, d_model=100, d_ff=400, world_size=2, bytes_per_element=2,
                                  flops_per_s=1e12, link_bytes_per_s=1e9)
    assert math.isclose(m["compute_s"], 2 * 2 * 1000 * 100 * 400 / 2 / 1e12)
    assert math.isclose(m["megatron_comm_s"], 2 * 0.5 * 1000 * 100 * 2 / 1e9)        # one all-reduce [T, d]
    assert math.isclose(m["allgather_comm_s"], 0.5 * 1000 * (400 + 100) * 2 / 1e9)   # gathers [T, d_ff], [T, d]
    fast = comm.comm_vs_compute_model(1000, 100, 400, 2, 2, 1e12, 1e11)
    assert fast["allgather_comm_over_compute"] < m["allgather_comm_over_compute"]


def test_dense_mlp_is_the_same_on_every_call():
    a, b = lab.dense_mlp(8, 16, seed=3), lab.dense_mlp(8, 16, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_attention_heads_are_head_major():
    """The dense attention equals per-head attention on qkv features laid out [head, (q,k,v), hd]."""
    import labs.lab05_tp_transformer as tb

    block = tb.dense_block(d_model=12, n_heads=3, d_ff=24, dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    attn = block.attn
    qkv = attn.qkv(x)                                    # [B, S, 36]
    heads = []
    for h in range(3):
        q, k, v = (qkv[..., (3 * h + i) * 4:(3 * h + i + 1) * 4] for i in range(3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(4)
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(F.softmax(scores, dim=-1) @ v)
    expected = attn.proj(torch.cat(heads, dim=-1))
    assert torch.allclose(attn(x), expected, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# On 2 ranks: one launch, this file is the worker
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks():
    res = launch(__file__, "labs", nproc=NPROC, timeout=240, stream=False,
                 env={"COURSE_SMOKE": "1", "DIST_TIMEOUT": "30"})
    return [res.results[r] for r in range(NPROC)]


def test_indivisible_sizes_raise_at_construction(ranks):
    for rep in ranks:
        errors = rep["errors"]
        assert "out_features of a column-parallel layer = 5 is not divisible" in errors["column"]
        assert "in_features of a row-parallel layer = 5 is not divisible" in errors["row"]
        assert "attention heads = 3 is not divisible" in errors["heads"]
        assert "d_ff = 9 is not divisible" in errors["run"]


def test_from_dense_layouts(ranks):
    for rank, rep in enumerate(ranks):
        lay = rep["layouts"]
        assert lay["column_weight_shape"] == [6 // NPROC, 4] and lay["column_bias_shape"] == [6 // NPROC]
        assert lay["row_weight_shape"] == [4, 6 // NPROC] and lay["row_bias_shape"] == [4]
        assert lay["column_is_chunk_r"] and lay["row_is_chunk_r"] and lay["row_bias_full"], rank


def test_mlp_lab_matches_dense(ranks):
    for rep in ranks:
        result = rep["mlp"]
        assert set(result["check"]) == {"allgather", "megatron"}
        for scheme, diffs in result["check"].items():
            assert lab.worst(diffs) < TOL64, (scheme, diffs)


def test_comm_lab_counts_bytes_as_the_formula_says(ranks):
    for rep in ranks:
        result = rep["comm"]
        assert len(result["comm_rows"]) == 4
        for row in result["comm_rows"]:
            assert row["sent/rank MB (counted)"] > 0
            assert math.isclose(row["sent/rank MB (counted)"], row["sent/rank MB (formula)"]), row
        s = result["sizes"]
        megatron = [tuple(c["shape"]) for c in result["calls"]["megatron"]]
        assert megatron == [(s["batch"], s["seq"], s["d_model"])] * 2
        assert set(result["seconds"]) == {"allgather", "megatron", "dense (one rank)"}
        assert result["layer"]["matmul_s"] > 0 and result["layer"]["all_gather_s"] > 0


def test_dtensor_parallelize_module_agrees_with_ours(ranks):
    for rep in ranks:
        result = rep["dtensor"]
        assert result["worst"] < TOL64, result
        assert result["placements"] == {"fc1.weight": ["Shard(dim=0)"], "fc1.bias": ["Shard(dim=0)"],
                                         "fc2.weight": ["Shard(dim=1)"], "fc2.bias": ["Replicate()"]}
        assert result["local_shapes"] == result["our_shapes"]


def test_transformer_block_trains_like_its_dense_twin(ranks):
    for rep in ranks:
        result = rep["block"]
        assert result["worst"] < TOL64, result["check"]
        assert result["heads_per_rank"] * NPROC == result["sizes"]["n_heads"]
        assert [c[:2] for c in result["calls"]] == [["forward", "all_reduce"]] * 2 + [["backward", "all_reduce"]] * 2
        losses = result["check"]["losses_dense"]
        assert len(losses) == result["sizes"]["steps"] and losses[-1] < losses[0]


def worker(ctx) -> dict:
    import labs.lab05_tp_dtensor as dtensor_lab
    import labs.lab05_tp_transformer as block_lab

    def error_of(fn):
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return "no error"

    errors = {
        "column": error_of(lambda: lab.ColumnParallelLinear.from_dense(nn.Linear(8, 5))),
        "row": error_of(lambda: lab.RowParallelLinear.from_dense(nn.Linear(5, 8))),
        "heads": error_of(lambda: block_lab.tensor_parallel_block(block_lab.dense_block(6, 3, 8))),
        "run": error_of(lambda: lab.run(ctx, d_ff=9)),
    }
    torch.manual_seed(0)  # the same dense layers on every rank
    dense, row_dense = nn.Linear(4, 6).to(ctx.device), nn.Linear(6, 4).to(ctx.device)
    col, row = lab.ColumnParallelLinear.from_dense(dense), lab.RowParallelLinear.from_dense(row_dense)
    n = 6 // ctx.world_size
    layouts = {
        "column_weight_shape": list(col.weight.shape), "column_bias_shape": list(col.bias.shape),
        "row_weight_shape": list(row.weight.shape), "row_bias_shape": list(row.bias.shape),
        "column_is_chunk_r": bool(torch.equal(col.weight, dense.weight[ctx.rank * n:(ctx.rank + 1) * n])
                                  and torch.equal(col.bias, dense.bias[ctx.rank * n:(ctx.rank + 1) * n])),
        "row_is_chunk_r": bool(torch.equal(row.weight, row_dense.weight[:, ctx.rank * n:(ctx.rank + 1) * n])),
        "row_bias_full": bool(torch.equal(row.bias, row_dense.bias)),
    }
    volume = comm.run(ctx, repeats=1)
    comm.print_summary(ctx, volume)
    return {"errors": errors, "layouts": layouts, "mlp": lab.run(ctx, dtype=torch.float64), "comm": volume,
            "dtensor": dtensor_lab.run(ctx, dtype=torch.float64),
            "block": block_lab.run(ctx, dtype=torch.float64)}


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker(ctx))
