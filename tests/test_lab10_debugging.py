"""Tests of lab 10's non-exercise parts: every planted failure ends, within its timeout, with the
diagnosis each tool should give; the silent bugs show their measured symptoms.

Run:  .venv/bin/python -m pytest tests/test_lab10_debugging.py -q

Pure functions (message parsing, flight-recorder tables, planting) run in this process. Four jobs
run at once in one module fixture, since much of their time is waiting: the hang lab ending in a
real hang (stack dumps taken while it hangs), the diagnose lab with `--lessons` (divergence, data,
mystery jobs), and the two crash drills that start no worker. The other two drills (a rank out of
memory, a rank killed) cost a full launch each: the notebook runs them in CI, and `run_drill`
checks each against its signature there. Nothing here checks a timing.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import mystery_jobs
from helpers.dist import error_line
from helpers.flight_recorder import flight_recorder_size, flight_records
from labs import lab10_crashes, lab10_hangs

HANG_S = 6.0  # the real hang's timeout: long enough for the stack dumps on a busy machine


# ------------------------------------------------------------------------------ pure functions
def test_short_error_cuts_detail_fingerprints_to_op_and_shape():
    text = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank 1 is running "
            "collective: CollectiveFingerPrint(SequenceNumber=1OpType=BARRIER).")
    assert lab10_hangs.short_error(text) == "mismatch: rank 0 runs ALLREDUCE[1] but rank 1 runs BARRIER"
    assert lab10_hangs.short_error("RuntimeError: Connection closed by peer [127.0.0.1]:5. This is "
                                   "typically caused by") == "RuntimeError: Connection closed by peer [127.0.0.1]:5"


def test_error_line_drops_gloo_source_paths():
    exc = RuntimeError("[/__w/pytorch/third_party/gloo/unbound_buffer.cc:78] Timed out waiting 1500ms for recv")
    assert error_line(exc) == "RuntimeError: Timed out waiting 1500ms for recv"


def test_flight_table_marks_collectives_a_rank_never_issued():
    recs = {0: [{"seq": 1, "op": "all_reduce", "sizes": [[8]], "where": "a.py:3 f"},
                {"seq": 2, "op": "all_reduce", "sizes": [[1]], "where": "a.py:5 f"}],
            1: [{"seq": 1, "op": "all_reduce", "sizes": [[8]], "where": "a.py:3 f"}]}
    rows = lab10_hangs.flight_table(recs)
    assert rows[-1] == {"#": 2, "rank 0": "all_reduce[1] at a.py:5 f", "rank 1": "(never issued)"}


def test_stack_dump_parsers():
    py_spy = ('Process 1: python x.py\nPython v3.11\n\nThread 10 (idle): "MainThread"\n'
              "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n    main (x.py:9)\n\n"
              'Thread 11 (idle): "Thread-1"\n    run (threading.py:1)\n')
    assert lab10_hangs.main_thread_stack(py_spy).splitlines() == [
        'Thread 10 (idle): "MainThread"', "    all_reduce (torch/distributed/distributed_c10d.py:3252)",
        "    main (x.py:9)"]
    output = ("[rank0]:hello\n[rank0]:Current thread 0x01 (most recent call first):\n"
              '[rank0]:  File "x.py", line 9 in main\n[rank0]:\n[rank1]:Thread 0x02 (most recent call first):\n'
              '[rank1]:  File "x.py", line 12 in barrier\n[rank1]:bye\n')
    dumps = lab10_hangs.faulthandler_dumps(output, 2)
    assert "line 9 in main" in dumps[0] and "line 12 in barrier" in dumps[1] and "bye" not in dumps[1]


def test_torchrun_summary_parsers():
    output = ("Root Cause (first observed failure):\n[0]:\n  time      : now\n  rank      : 1 (local_rank: 1)\n"
              "  exitcode  : -9 (pid: 5)  (SIGKILL)\n  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received\n"
              "=====\n")
    assert lab10_crashes.root_cause(output) == {"rank": "1 (local_rank: 1)", "exitcode": "-9 (pid: 5)  (SIGKILL)",
                                                "error_file": "<N/A>", "traceback": "Signal 9 (SIGKILL) received"}
    assert lab10_crashes.last_exception_line("x\n[rank1]:RuntimeError: boom\ntorch.distributed.DistStoreError: "
                                             "Timed out\n") == "torch.distributed.DistStoreError: Timed out"


def test_plants_are_seeded_and_cover_every_bug():
    assert [mystery_jobs.plant(s) for s in range(40)] == [mystery_jobs.plant(s) for s in range(40)]
    assert set(mystery_jobs.plant(s) for s in range(200)) == set(mystery_jobs.BUGS)
    forms = set()
    for seed in range(60):
        for world in (2, 3, 4):
            cfg = mystery_jobs.job_config(seed, world)
            assert cfg["size"] == cfg["local_batch"] * cfg["steps_per_epoch"] * world
            assert 1 <= cfg["bug_step"] < cfg["epochs"] * cfg["steps_per_epoch"] - 1
            assert 0 <= cfg["odd_rank"] < world
            assert "broadcast" not in cfg["order"] or cfg["odd_rank"] == 0, "a broadcast from a rank in step"
            forms.add((cfg["lone_op"], cfg["order"], cfg["every_rank"], cfg["epochs"]))
    assert {f[0] for f in forms} == set(mystery_jobs.LONE_OPS)
    assert {f[1] for f in forms} == set(mystery_jobs.ORDER_PAIRS)
    assert {f[2] for f in forms} == {True, False} and {f[3] for f in forms} == {2, 3}


def test_public_jobs_show_each_bug_in_the_forms_that_defeat_shortcuts():
    """The public diagnose jobs must keep catching the shortcuts their messages name (the seeds
    were picked for these forms: a change to job_config must pick them again)."""
    from tests.public.test_lab10_debugging import JOBS

    cfg = {(bug, seed, world): mystery_jobs.job_config(seed, world) for bug, seed, world in JOBS}
    forms = lambda bug: [(world, c) for (b, _, world), c in cfg.items() if b == bug]  # noqa: E731
    for bug in mystery_jobs.BUGS:
        assert {world for world, _ in forms(bug)} >= {2, 3}, f"{bug}: on 2 and on 3 ranks"
    # the rank blamed is not the culprit: a lone collective on a rank other than 0
    assert any(c["odd_rank"] != 0 for _, c in forms("collective_on_one_rank"))
    # the error text does not tell the hangs apart: enough jobs that some time out in each bug
    assert len(forms("collectives_in_different_orders")) >= 4
    assert {c["lone_op"] for _, c in forms("collective_on_one_rank")} == set(mystery_jobs.LONE_OPS)
    assert len({c["order"] for _, c in forms("collectives_in_different_orders")}) >= 3
    # ranks 0 and 1 agree, rank 2 alone differs
    for bug in ("different_initialisation", "random_state"):
        assert any(world == 3 and not c["every_rank"] and c["odd_rank"] == 2 for world, c in forms(bug)), bug
    # the same shard everywhere as well as the whole dataset
    assert {c["every_rank"] for _, c in forms("no_distributed_sampler")} == {True, False}
    # a logged loss that rank 0 did not compute itself
    assert any(not c["every_rank"] and c["odd_rank"] != 0 for _, c in forms("loss_logged_from_one_rank"))
    assert any(c["epochs"] == 3 for _, c in forms("no_set_epoch"))


def test_hidden_jobs_are_other_jobs():
    hidden = pytest.importorskip("tests.hidden.test_lab10_debugging")  # not in the student edition
    from tests.public.test_lab10_debugging import JOBS

    public = {seed for _, seed, _ in JOBS}
    assert not public & ({seed for _, seed, _ in hidden.JOBS} | {seed for seed, _ in hidden.RANDOM_JOBS})
    assert {world for _, _, world in hidden.JOBS} == {2, 3, 4}


def test_flight_recorder_size_reads_the_variables_as_torch_does(monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert flight_recorder_size() == 2000  # on by default (FlightRecorder.hpp)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "30")
    assert flight_recorder_size() == 30
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert flight_recorder_size() == 0 and flight_records() == []


def test_count_collectives_counts_inputs_and_pauses():
    import torch.distributed as dist

    from helpers.comm_count import count_collectives
    from helpers.dist import distributed

    with distributed():
        with count_collectives() as log:
            dist.all_reduce(torch.ones(4))
            with log.paused():
                dist.all_reduce(torch.ones(100))
            out = [torch.empty(3, dtype=torch.float64)]
            dist.all_gather(out, torch.ones(3, dtype=torch.float64))
        assert log.ops == [("allreduce", 16), ("allgather", 24)]


# ------------------------------------------------------------------------------ the launches
@pytest.fixture(scope="module")
def runs():
    """The three jobs at once; each value is what its function returned (or the exception)."""
    tasks = {
        "hung": lambda: lab10_hangs.launch_hung_job(nproc=2, hang_s=HANG_S, timeout=240),
        "silent": lambda: lab10_diagnose_launch(),
        # the two drills that start no worker (cheap); the notebook runs all four, each checked
        # by run_drill against its signature
        "port in use": lambda: lab10_crashes.run_drill("port in use", 1, 240),
        "rendezvous never completes": lambda: lab10_crashes.run_drill("rendezvous never completes", 1, 240),
    }
    with ThreadPoolExecutor(len(tasks)) as pool:
        futures = {name: pool.submit(fn) for name, fn in tasks.items()}
        out = {}
        for name, future in futures.items():
            try:
                out[name] = future.result()
            except Exception as exc:  # noqa: BLE001: each test reports its own job's failure
                out[name] = exc
    return out


def lab10_diagnose_launch():
    from helpers.launch import launch
    return launch("labs/lab10_diagnose.py", "--lessons", nproc=2, timeout=240, stream=False,
                  env={"LAB10_SEED": "4"}, fork_ranks=True)  # what the jobs log, not torchrun's report


def get(runs, name):
    value = runs[name]
    if isinstance(value, Exception):
        raise AssertionError(f"the {name} launch failed: {value}")
    return value


def test_real_hang_ends_with_the_timeout_error_naming_a_rank(runs):
    job = get(runs, "hung")
    assert job.error is not None, "the planted hang did not fail the job"
    assert job.error.rank in (0, 1) and "Timed out" in job.error.summary, job.error.summary
    assert job.result.seconds < HANG_S + 120, "the hang outlived its timeout by far"


def test_stack_dumps_show_where_each_rank_waits(runs):
    job = get(runs, "hung")
    assert sorted(job.pids) == [0, 1], f"the ranks never reached the planted hang: {job.pids}"
    assert "log_final_loss" in job.faulthandler.get(0, ""), job.faulthandler
    assert "finish_training" in job.faulthandler.get(1, "") and "log_final_loss" not in job.faulthandler.get(1, "")
    if lab10_hangs.py_spy_path():  # installed with requirements.txt; may lack ptrace permission
        dumps = {r: d for r, d in job.py_spy.items() if not d.startswith("py-spy could not")}
        if dumps:
            assert "all_reduce" in lab10_hangs.main_thread_stack(dumps[0])
            assert "barrier" in lab10_hangs.main_thread_stack(dumps[1])


def test_clinic_each_tool_says_what_it_should(runs):
    job = get(runs, "hung")
    clinic = {r: job.result.results[r]["clinic"] for r in (0, 1)}
    said = lambda case: " | ".join(str(clinic[r][case]["said"]) for r in (0, 1))  # noqa: E731
    assert "Timed out" in said("one rank calls it, plain")
    assert "Timed out" in said("different orders, plain")
    assert "ALLREDUCE" in said("different orders, DETAIL") and "BROADCAST" in said("different orders, DETAIL")
    assert "ALLREDUCE[1]" in said("one rank calls it, DETAIL") and "BROADCAST[8]" in said("one rank calls it, DETAIL")
    assert "Ranks 1 failed to pass monitoredBarrier" in clinic[0]["a late rank, monitored_barrier"]["said"]
    # the collective called by rank 0 alone paired with rank 1's gradient all-reduce: 100 + 2
    same = clinic[1]["one rank calls it, same shape next, plain"]
    assert same["error"] is None and same["seen"]["gradient sum"] == 102.0, same
    assert "monitoredBarrier" in said("one rank calls it, same shape next, DETAIL")


def test_flight_recorder_shows_the_extra_collective(runs):
    job = get(runs, "hung")
    flight = {r: job.result.results[r]["clinic"]["one rank calls it, plain"]["flight"] for r in (0, 1)}
    assert flight[0] and flight[1], "the flight recorder recorded nothing (is TORCH_FR_BUFFER_SIZE=0 set?)"
    last0, last1 = flight[0][-1], flight[1][-1]
    assert last0["op"] == "all_reduce" and last0["sizes"] == [[1]]
    assert last1["op"] == "broadcast" and last1["seq"] == last0["seq"]


def test_detail_costs_something(runs):
    overhead = get(runs, "hung").result.results[0]["detail_overhead"]
    assert overhead["plain"] > 0 and overhead["DETAIL"] > 0
    assert len(overhead["rounds"]["plain"]) == len(overhead["rounds"]["DETAIL"]) >= 3
    assert overhead["DETAIL"] in overhead["rounds"]["DETAIL"]


def test_detail_verdict_needs_every_round_slower():
    cost = lambda plain, detail: {"plain": sorted(plain)[1], "DETAIL": sorted(detail)[1],  # noqa: E731
                                  "rounds": {"plain": plain, "DETAIL": detail}}
    assert "slower in every round" in lab10_hangs.detail_verdict(cost([1e-4, 1.1e-4, 1.2e-4], [2e-4, 2.5e-4, 3e-4]))
    said = lab10_hangs.detail_verdict(cost([1e-4, 1.1e-4, 3e-4], [2e-4, 2.5e-4, 2.6e-4]))
    assert "no clear cost on this run" in said and "(2.3x)" in said


def test_divergence_symptoms(runs):
    out = get(runs, "silent").rank0["divergence"]
    v = out["variants"]
    first = {name: rec["first"] for name, rec in v.items()}
    assert first["healthy"] is None, "dropout masks differ across ranks, the replicas must not"
    assert first["different initialisation"]["step"] == 0
    assert first["forgotten broadcast"] == {"step": 0, "names": ["backbone.weight", "backbone.bias"]}
    assert first["random state"] == {"step": out["reinit_step"] + 1, "names": ["backbone.weight"]}
    assert first["buffer not synchronised"] == {"step": 1, "names": ["norm.running_mean", "norm.running_var"]}
    nondet = v["non-deterministic reduction"]
    assert v["healthy"]["norms_differ_at"] == [], "the healthy ranks sum their norms in one order"
    assert nondet["norms_differ_at"], "the rank-dependent order gave equal norms at every step"
    assert nondet["first"] is not None and 0 < nondet["max_diff"][-1] < 1e-5
    assert nondet["first"]["step"] > nondet["norms_differ_at"][0], "a drift before its cause"
    for name, rec in v.items():
        check = rec["check"]
        if "unsolved" in check:
            continue
        assert (check["found"] or None) == (None if rec["first"] is None else check["found"]), name
        if rec["first"] is not None:
            assert check["found"]["step"] == rec["first"]["step"], name
        assert check["bytes_per_check"] < rec["bytes_per_check"] / 10, name


def test_data_symptoms(runs):
    out = get(runs, "silent").rank0["data"]
    n = out["world_size"]
    assert out["without set_epoch"]["repeats_of_epoch_0"] == out["without set_epoch"]["later_epochs"]
    assert out["with set_epoch"]["repeats_of_epoch_0"] == 0
    assert out["healthy"]["param_gap_to_reference"] < 1e-5
    assert out["no sampler"]["distinct_fraction"] == pytest.approx(1 / n)
    assert out["no sampler"]["param_gap_to_one_process_batch_B"] < 1e-6
    ratios = {k: r["gradient / reference"] for k, r in out["reduced twice"].items()}
    assert ratios == pytest.approx({"DDP alone (healthy)": 1.0, "DDP + all_reduce(grad) / N": 1.0,
                                    "DDP + all_reduce(grad)": n, "DDP + loss / N": 1 / n}, rel=1e-4)
    lr = list(out["learning rate"].values())
    assert lr[1]["loss"] > lr[0]["loss"] and lr[2]["loss"] < lr[1]["loss"], lr
    gap = {k: v["parameter gap to the healthy run"] / v["parameter change in the healthy run"]
           for k, v in out["gradients x N, by optimizer"].items()}
    assert gap["SGD"] > 0.1 and gap["Adam"] < 1e-4, gap  # SGD's steps grow N times, Adam's barely change
    ag = out["all_gather backward"]  # torch's backward is wrong on gloo for a transposed gradient
    size = ag["gradient size (max |reference|)"]
    assert ag["torch.distributed.nn.functional.all_gather"] > 0.1 * size, ag
    assert ag["the same, gradient made contiguous"] < 1e-5 * size, ag
    assert ag["an autograd function of our own (reduce-scatter)"] < 1e-5 * size, ag


def test_mystery_jobs_report_what_diagnose_reads(runs):
    res = get(runs, "silent").rank0
    for (bug, _, _), out in zip(res["jobs"], res["outputs"]):
        job = mystery_jobs.outputs_from_dict(out)
        assert bool(job.error) == (bug in ("collective_on_one_rank", "collectives_in_different_orders")), bug
        for rep in job.reports.values():
            assert {"local_loss", "logged_loss", "grad_norm", "samples", "param_digest", "flight"} <= set(rep)


def test_startup_crash_drills_end_with_their_diagnosis(runs):
    port = get(runs, "port in use")
    assert "EADDRINUSE" in port.error and port.failed_rank is None, port.error
    rendezvous = get(runs, "rendezvous never completes")
    assert "1/2 clients joined" in rendezvous.error, rendezvous.error
    assert rendezvous.seconds < 120, "torchrun's rendezvous timeout (3 s) did not end the job"


def test_drill_signatures_tell_the_crashes_apart():
    drill = lambda name, rank, error, output="": lab10_crashes.Drill(name, 1.0, rank, error, {}, output)  # noqa: E731
    sig = lab10_crashes.SIGNATURES
    assert sig["out of memory"](drill("out of memory", 1, "RuntimeError: DefaultCPUAllocator: can't allocate memory"))
    assert not sig["out of memory"](drill("out of memory", 0, "RuntimeError: Connection closed by peer"))
    assert sig["killed mid-step"](drill("killed mid-step", 0, "RuntimeError: Connection closed",
                                        "exitcode  : -9 (pid: 5)  (SIGKILL)"))
    assert not sig["killed mid-step"](drill("killed mid-step", 1, "", "exitcode  : 1"))


# ------------------------------------------------------------------------------ divergence verdicts
def _record(curve, names=("backbone.weight",), causes=()):
    first = next(({"step": i, "names": list(names)} for i, d in enumerate(curve) if d > 0), None)
    return {"max_diff": list(curve), "first": first, "norms_differ_at": list(causes)}


def test_divergence_trend_flips():
    from labs.lab10_divergence import symptom, trend
    assert trend(1e-8, 1e-6) == "grew" and trend(1e-6, 1e-8) == "shrank"
    assert trend(1e-8, 1.05e-8) == "stayed within 10%"
    s = symptom("forgotten broadcast", _record([0.5, 0.5, 2.0]))
    assert (s.first_step, s.trend) == (0, "grew") and "first differs after 0 steps" in s.sentence
    s = symptom("healthy", _record([0.0, 0.0, 0.0]))
    assert s.first_step is None and "bitwise equal at every check" in s.sentence


def test_nondeterministic_verdict_says_when_nothing_drifted():
    """The variant's drift depends on float rounding: the sentence says which case this run was."""
    from labs.lab10_divergence import symptom
    name = "non-deterministic reduction"
    drifted = symptom(name, _record([0.0, 1.5e-8, 1.5e-8], causes=(0, 1)))
    assert drifted.first_step == 1 and "differed in the last bits at 2 of 2 steps" in drifted.sentence
    equal = symptom(name, _record([0.0, 0.0, 0.0]))
    assert equal.first_step is None and "bitwise-equal clipping norms at every step" in equal.sentence
    absorbed = symptom(name, _record([0.0, 0.0, 0.0], causes=(1,)))
    assert absorbed.first_step is None and "rounded away in the update" in absorbed.sentence
    assert "re-initialisation ran during step 3" in symptom("random state", _record([0, 0, 0, 0, 1.0]), 3).sentence


def test_healthy_verdict_flips():
    from labs.lab10_divergence import healthy_stays_equal
    assert healthy_stays_equal({"variants": {"healthy": _record([0.0, 0.0])}})
    assert not healthy_stays_equal({"variants": {"healthy": _record([0.0, 1e-9])}})


def test_rank_ordered_norm_differs_in_the_last_bits_only():
    """The planted non-determinism: the same gradients, two orders, sums that differ (almost
    always) but only in the last bits; one order, the same sum."""
    from labs.lab10_divergence import total_norm_in_rank_order
    gen = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(20):
        grads = [torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen), torch.randn(4, 32, generator=gen)]
        a, b = total_norm_in_rank_order(grads, 0), total_norm_in_rank_order(grads, 1)
        assert a == total_norm_in_rank_order(grads, 0)
        assert torch.isclose(a, b, rtol=1e-6, atol=0), (a, b)
        differ += bool(a != b)
    assert differ >= 10, f"two orders gave the same float32 norm in {20 - differ} of 20 draws"


def test_data_verdicts_flip():
    from labs import lab10_data as data_lab
    twice = lambda healthy, summed: {"DDP alone (healthy)": {"loss after the epoch": healthy},  # noqa: E731
                                     "DDP + all_reduce(grad)": {"loss after the epoch": summed}}
    assert data_lab.summed_verdict(twice(1.0, 0.5), 2).endswith("they trained better on this run")
    assert data_lab.summed_verdict(twice(1.0, 2.0), 2).endswith("they trained worse on this run")
    lines = data_lab.learning_rate_lines(one=0.1, same_lr=0.5, scaled=0.15, world_size=4)
    assert lines[0].endswith("it learned less in the epoch") and "(the linear scaling rule at work)" in lines[1]
    assert "(not most of it on this run)" in data_lab.learning_rate_lines(0.1, 0.5, 0.45, 4)[1]
    assert data_lab.learning_rate_lines(0.5, 0.1, 0.1, 4) == [
        "4 ranks at the same learning rate: 0.1 vs 0.5 for one process with batch B: not less on this run"]
    assert data_lab.all_gather_verdict(0.3, 1.0).endswith("and nothing raised")
    assert data_lab.all_gather_verdict(1e-8, 1.0).startswith("not on this run")


def test_hang_verdicts_flip():
    assert lab10_hangs.blame_verdict(0, 0) == "that is the rank with the extra all-reduce"
    assert lab10_hangs.blame_verdict(1, 0).startswith("rank 1 did nothing wrong")
    here, there = ("all_reduce", "log_final_loss"), ("barrier", "finish_training")
    assert lab10_hangs.waits_verdict({0: here, 1: there}).startswith("the ranks wait in different collectives")
    assert lab10_hangs.waits_verdict({0: here, 1: here}).startswith("not on this run")
    assert lab10_hangs.waits_verdict({0: here, 1: None}) is None


def test_blame_line_flips():
    assert lab10_crashes.blame_line(1, 0).endswith("rank 0: the survivor, whose error is a consequence")
    assert lab10_crashes.blame_line(1, 1) == "rank 1 was killed; the launcher blames rank 1"
    assert lab10_crashes.blame_line(1, None).endswith("blames no rank")
