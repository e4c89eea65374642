"""Notebook 09's verdicts (labs/lab09_report.py), each fed both cases, in this process. The same
functions read the launch's real reports in tests/test_lab09_mesh.py.

Run:  .venv/bin/python -m pytest tests/test_lab09_report.py -q
"""
from __future__ import annotations

from labs import lab09_report as report


def config(name, diff, dp=2, tp=2, sp=False):
    return {"dp": dp, "tp": tp, "sp": sp, "max_param_diff": diff, "step_s": 0.01,
            "held": {"total": 100}, "activation_bytes": 50}


def test_configurations_within_or_not_and_unsolved():
    res = {r: {"configs": {"dp4": config("dp4", 1e-7, 4, 1), "dp2 x tp2": {"unsolved": "Exercise f_g_backward ..."}}}
           for r in range(2)}
    ok = report.configurations(res, 1e-5)
    assert ok.within and len(ok.rows) == 1 and ok.unsolved == ["Exercise f_g_backward ..."] and "1 of 2" in ok.text
    res[1]["configs"]["dp4"] = config("dp4", 1e-3, 4, 1)
    bad = report.configurations(res, 1e-5)
    assert not bad.within and "NOT all within" in bad.text


def test_dtensor_check_flips():
    assert report.dtensor_check({"worst": 1e-7}, 1e-5) == "largest difference 1.0e-07: within the tolerance 1e-05"
    assert "NOT within" in report.dtensor_check({"worst": 1e-3}, 1e-5)


def collectives(calls_f, calls_b, sent_f, sent_b):
    return {"forward": {"calls": calls_f, "sent_bytes": sent_f}, "backward": {"calls": calls_b, "sent_bytes": sent_b}}


def test_sp_traffic_ratios_and_unsolved():
    s0 = {"tp": {"collectives": collectives({"all_reduce": 4}, {"all_reduce": 4}, 100, 100)},
          "sp": {"collectives": collectives({"all_gather": 4, "reduce_scatter": 4}, {"all_gather": 8, "reduce_scatter": 4}, 100, 150)}}
    sent = report.sp_traffic(s0)
    assert "forward 1.00x, backward 1.50x" in sent.text and "20 against 8 (2.5x)" in sent.text
    stub = report.sp_traffic({**s0, "tp": {"collectives": {"unsolved": "Exercise f_g_backward"}}})
    assert stub.unsolved == ["Exercise f_g_backward"] and stub.text == "" and len(stub.rows) == 2


def row(name, ratio, before=0.5, fixed=1.0, predicted=10.0, states=1.0):
    return {"configuration": name, "predicted / measured": ratio, "before: predicted / measured": before,
            "of which fixed cost of calls ms": fixed, "predicted ms": predicted, "of which bytes ms": 0.1,
            "collectives per step": 9, "states: predicted / measured": states, "activations: predicted / measured": 0.98}


def test_validation_verdict_flips():
    good = report.validation_verdict([row("dp4", 1.1), row("tp4", 0.9, fixed=5.0)])
    assert "within 1.3x for every one" in good and "largest share of the prediction for tp4" in good and "(exact)" in good
    bad = report.validation_verdict([row("dp4", 1.1), row("tp4", 0.5, states=1.01)])
    assert "NOT within 1.3x for tp4" in bad and "(exact)" not in bad


def published_row(model, published, predicted):
    return {"model": model, "published TFLOP/s/GPU": published, "predicted TFLOP/s/GPU": predicted,
            "predicted / published": predicted / published, "efficiency that matches": 0.7 * published / predicted}


def test_published_trends_flip():
    rising = report.published([published_row("GPT 1.7B", 137, 200), published_row("GPT 1T", 163, 190)], 0.7)
    assert "published TFLOP/s per GPU 137 -> 163 (rises)" in rising and "predicted 200 -> 190 (does not rise)" in rising
    assert "more than was published for 2 of 2" in rising
    falling = report.published([published_row("GPT 1.7B", 170, 150), published_row("GPT 1T", 160, 160)], 0.7)
    assert "(does not rise)" in falling.split("published TFLOP/s")[1] and "for 0 of 2" in falling


EXPLORED = {"error": None, "config": {"dp": 8, "tp": 8, "pp": 4, "micro_batches": 16, "schedule": "1F1B",
                                      "virtual_stages": 1},
            "model": {"name": "70B-class GPT", "layers": 80, "hidden": 8192, "heads": 64, "seq": 4096,
                      "global batch": 1024, "parameters": 68.7e9},
            "schedule": {"bubble / ideal": 0.19, "held on stage 0": 4}, "links": [{"axis": "tensor"}]}
STUB = ("Exercise {} (notebook 09_combining.ipynb): predict it. Fill in the block in labs/lab09_planner.py "
        "and run ./run.sh check 09")


def test_explorer_view_without_the_planner():
    """Unsolved: the model and the layout, then one notice per exercise still to write."""
    r = dict(EXPLORED, unsolved=[STUB.format("plan_memory"), STUB.format("plan_step_time")])
    view = report.explorer_view(r, 80)
    assert len(view) == 4 and "68.7B parameters" in view[0] and "per training step" in view[0]
    assert "plan_memory" in view[2] and "plan_step_time" in view[3], \
        "the panel does not name both exercises the planner needs"
    assert len(report.explorer_view({"error": "5 GPUs are not a multiple of tp x pp = 8"}, 80)) == 1


def test_explorer_view_with_one_exercise_written():
    """plan_memory written: its figure, and the other exercise's notice; both: the summary too."""
    memory = {"parameters": 10.0, "gradients": 10.0, "optimizer state": 20.0, "activations": 30.0}
    view = report.explorer_view(dict(EXPLORED, memory=memory, unsolved=[STUB.format("plan_step_time")]), 80)
    assert len(view) == 4 and "<img" in view[2] and "plan_step_time" in view[3] and "plan_memory" not in view[3]
    time = {"compute": 1.0, "tensor parallel": 0.2, "pipeline messages": 0.1, "bubble": 0.2, "data parallel": 0.1}
    summary = {"fits": True, "GB per GPU": 70.0, "step s": 1.6, "MFU": 0.4, "tokens/s": 2.6e6}
    view = report.explorer_view(dict(EXPLORED, memory=memory, time=time, summary=summary), 80)
    assert len(view) == 4 and "fits" in view[3] and "1.60 s per training step" in view[3]


