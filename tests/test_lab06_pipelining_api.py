"""Tests of labs/lab06_pipelining_api.py: the Transformer LM and its data in this process, and the
lab on 2 ranks in smoke mode: torch.distributed.pipelining with ScheduleGPipe and Schedule1F1B
(tracer frontend) and Schedule1F1B (manual frontend) trains exactly like one process (losses
rtol 1e-4, every parameter atol 1e-4 after AdamW, against the lab's single-process run).
"""
from __future__ import annotations

import pytest
import torch

from labs import lab06_pipelining_api as lab
from tests.harness import launch_ranks


def test_token_data_is_deterministic_and_learnable():
    config = lab.LMConfig(batch=4, seq=8)
    a, b = lab.make_token_batches(config, 3), lab.make_token_batches(config, 3)
    assert a.shape == (3, 4, 9) and a.dtype == torch.long and torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < config.vocab
    # each token has at most 4 possible successors: far less than log(vocab) nats of entropy
    pairs = {(x, y) for row in a.view(-1, 9).tolist() for x, y in zip(row, row[1:])}
    successors = {}
    for x, y in pairs:
        successors.setdefault(x, set()).add(y)
    assert max(len(s) for s in successors.values()) <= 4


def test_model_shapes_and_manual_stage_pieces():
    config = lab.LMConfig(layers=4)
    model = lab.build_model(config)
    tokens = lab.make_token_batches(config, 1)[0, :, :-1]
    logits = model(tokens)
    assert logits.shape == (config.batch, config.seq, config.vocab)
    assert lab.split_layers(config, 2) == [2]
    with pytest.raises(ValueError):
        lab.split_layers(config, 3)
    with pytest.raises(ValueError):
        lab.schedule_class("Interleaved")


@pytest.fixture(scope="module")
def lab_run():
    return launch_ranks("labs/lab06_pipelining_api.py", "--preset", "smoke", nproc=2, timeout=300,
                        env={"DIST_TIMEOUT": "60"})


def test_pipelined_losses_equal_single_process(lab_run):
    config = lab.Run(**lab_run[0]["config"])
    assert config == lab.Run.preset("smoke")
    reference = lab_run[1]["reference_losses"]   # train_reference, in another process
    assert len(reference) == config.steps >= 2
    assert reference[-1] < reference[0]   # it learns
    runs = lab_run[1]["runs"]
    planned = lab.planned_runs()
    assert set(runs) == {f"{s}/{f}" for f, schedules in planned.items() for s in schedules}
    assert {key.split("/")[0] for key in runs} == {"GPipe", "1F1B"}
    for key, run in runs.items():
        assert run["losses"] == pytest.approx(reference, rel=lab.LOSS_RTOL), key


def test_pipelined_parameters_equal_single_process(lab_run):
    names = {n for n, _ in lab.build_model(lab.LMConfig()).named_parameters()}
    for key in lab_run[0]["runs"]:
        covered = set()
        for rank in (0, 1):
            run = lab_run[rank]["runs"][key]
            assert run["max_param_diff"] < lab.PARAM_ATOL, (key, rank)
            covered |= set(run["param_names"])
        assert covered == names, key   # the stages together hold the whole model, once
        assert not set(lab_run[0]["runs"][key]["param_names"]) & set(
            lab_run[1]["runs"][key]["param_names"])
