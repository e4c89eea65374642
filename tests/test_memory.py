"""helpers/memory.py against torch's own, in this process: the saved-tensor counter
(`SavedTensorBytes`, a saved-tensors hook) against autograd's record of what its graph keeps
(`graph_saved_bytes`, each node's `_saved_*` fields) on the same forward, for notebook 07's blocks
(fp32 and bf16 autocast) and notebook 12's language model; the profiler's peak against a known
allocation.

Run:  .venv/bin/python -m pytest tests/test_memory.py -q
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.memory import SavedTensorBytes, graph_saved_bytes, is_parameter, peak_allocated


def test_counter_equals_the_graph_on_notebook07_blocks():
    from labs.lab07_memory import make_blocks, make_regression_data, run_blocks

    model = make_blocks(32, 3)
    x, y = make_regression_data(16, 32)
    params = list(model.parameters())
    for autocast in (False, True):
        with SavedTensorBytes(exclude=params) as saved:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = run_blocks(model, x)
            loss = F.mse_loss(out.float(), y)
        assert saved.bytes == graph_saved_bytes(loss, params) > 0, autocast
        assert (saved.weight_copy_bytes > 0) == autocast     # autocast's bf16 copies of the weights


def test_counter_equals_the_graph_on_notebook12_model_without_being_told_the_parameters():
    from labs.lab12_model import LMConfig, build_model, lm_loss

    cfg = LMConfig(dim=32, heads=4, layers=2, ffn=64, seq=16, batch=2)
    model = build_model(cfg, "cpu")
    x = torch.randint(0, 256, (cfg.batch, cfg.seq))
    with SavedTensorBytes(skip_parameters=True) as skipping:      # counters do not nest: torch
        loss = lm_loss(model(x), x)                                # packs with the innermost hooks
    with SavedTensorBytes(exclude=model.parameters()) as told:
        lm_loss(model(x), x)
    assert skipping.bytes == told.bytes == graph_saved_bytes(loss, model.parameters()) > 0


def test_the_graph_sees_what_a_counter_would_miss():
    """The opposite case: tensors saved before the counter starts are in the graph, not in the count."""
    w = torch.randn(8, 8, requires_grad=True)
    h = torch.tanh(torch.randn(4, 8) @ w)                   # saved outside the counter
    with SavedTensorBytes(exclude=[w]) as saved:
        loss = torch.sigmoid(h).sum()
    assert 0 < saved.bytes < graph_saved_bytes(loss, [w])


def test_parameters_views_and_casts():
    p = torch.nn.Parameter(torch.randn(4, 4))
    assert is_parameter(p) and is_parameter(p.t()) and is_parameter(p.to(torch.bfloat16).t())
    assert not is_parameter(p * 2) and not is_parameter(torch.randn(3))


def test_peak_of_a_known_allocation():
    def step():
        a = torch.empty(2**18)                  # 1 MiB
        b = torch.empty(2**18)                  # another while the first is alive
        del a, b
        torch.empty(2**18)                      # after both are freed: no higher

    peak = peak_allocated(step)
    assert 2 * 2**20 <= peak < 2 * 2**20 + 64 * 2**10, peak
