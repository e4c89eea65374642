"""Lab 01 (the machine): why training is spread over many devices, and what this machine can run
side by side.

Run:  ./run.sh labs/lab01_machine.py      (./run.sh 01 runs it with lab01_gil_threads.py)

- Why parallelise: the memory and compute of a 1-trillion-parameter model (the 3072-GPU run of
  Narayanan et al. 2021, arXiv:2104.04473) against one GPU and one node, computed.
- This machine: usable cores, physical cores and SMT (as far as psutil can tell), the SIMD width of
  torch's CPU kernels, the GIL.
- Processes: how new workers start (`worker_context`), what starting one costs, and how a function
  reaches another process (pickled by reference: module and name), which is why a process pool
  cannot run a function defined in a notebook.

Rank 0 prints the machine and the scale tables; the other ranks have nothing to do.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import sysconfig
import threading
from typing import Any, Callable

import psutil
import torch

from helpers.bench import measure
from helpers.dist import distributed

# --- why parallelise: one large run, computed ---------------------------------------------------

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (arXiv:2104.04473): a 1-trillion-parameter GPT, 3072 A100 GPUs, 502 petaFLOP/s in
# all; their training-time estimate assumes 450 billion tokens and 8 * tokens * parameters FLOPs
# (forward, backward, and the forward again for activation recomputation).
TRILLION_RUN = {"params": 1e12, "gpus": 3072, "flops_per_s": 502e15, "tokens": 450e9}
A100_BYTES = 80e9          # an A100 80 GB (NVIDIA A100 datasheet)
GPUS_PER_NODE = 8          # a DGX A100 node; PCIe slots and lanes keep a node at about 8-10 GPUs
# Mixed-precision Adam, per parameter (Rajbhandari et al. 2020, ZeRO, arXiv:1910.02054, sec. 3.1):
# fp16 weights 2 + fp16 gradients 2 + fp32 master weights, momentum and variance 4 + 4 + 4.
BYTES_PER_PARAM = {"fp16 weights": 2, "fp16 gradients": 2, "fp32 Adam state and master weights": 12}
SECONDS_PER_DAY = 86_400


def scale_of_a_large_run(run: dict[str, float] = TRILLION_RUN, gpu_bytes: float = A100_BYTES,
                         gpus_per_node: int = GPUS_PER_NODE) -> list[dict[str, Any]]:
    """Rows of what `run` needs against one GPU: memory to hold it, time to train it, nodes."""
    params = run["params"]
    weights = params * BYTES_PER_PARAM["fp16 weights"]
    training_state = params * sum(BYTES_PER_PARAM.values())
    flops = 8 * run["tokens"] * params
    per_gpu = run["flops_per_s"] / run["gpus"]
    days = flops / run["flops_per_s"] / SECONDS_PER_DAY
    return [
        {"quantity": "fp16 weights alone (inference)", "value": f"{weights / 1e12:.0f} TB",
         "one GPU's worth": f"{weights / gpu_bytes:.0f} GPUs of {gpu_bytes / 1e9:.0f} GB"},
        {"quantity": "weights + gradients + Adam state (training, 16 B/parameter)",
         "value": f"{training_state / 1e12:.0f} TB",
         "one GPU's worth": f"{training_state / gpu_bytes:.0f} GPUs, before any activation"},
        {"quantity": f"training compute, 8 x {run['tokens']:.3g} tokens x {params:.3g} parameters",
         "value": f"{flops:.2g} FLOPs",
         "one GPU's worth": f"{days * run['gpus'] / 365:.0f} years on one GPU at "
                            f"{per_gpu / 1e12:.0f} TFLOP/s"},
        {"quantity": f"the same on {run['gpus']} GPUs ({run['flops_per_s'] / 1e15:.0f} PFLOP/s)",
         "value": f"{days:.0f} days",
         "one GPU's worth": f"{run['gpus'] / gpus_per_node:.0f} nodes of {gpus_per_node} GPUs"},
    ]


# --- this machine --------------------------------------------------------------------------------

def available_cores() -> int:
    """Logical cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compute_cores() -> int:
    """How many CPU-bound workers can run side by side: the usable logical cores, capped at the
    physical cores (two SMT siblings share one core's execution units)."""
    physical = psutil.cpu_count(logical=False) or available_cores()
    return max(1, min(available_cores(), physical))


def smt_summary(logical: int | None, physical: int | None) -> str:
    """What the logical and physical core counts say about SMT, without assuming 2 per core.

    Apple silicon has no SMT (1 logical per physical); Intel hybrid chips mix cores with and
    without a sibling; psutil returns None for the physical count where the OS does not say."""
    if not logical or not physical:
        return "unknown: this system does not report its physical cores"
    if logical == physical:
        return "no SMT: 1 logical core per physical core"
    if logical % physical == 0:
        return f"SMT: {logical // physical} logical per physical core"
    return (f"SMT on some cores only: {logical} logical on {physical} physical "
            "(e.g. performance cores with a sibling, efficiency cores without)")


_VECTOR_BITS = {"AVX512": 512, "AVX2": 256, "SVE256": 256}  # torch's CPU kernels' instruction set


def simd_summary(capability: str | None = None) -> str:
    """The SIMD width torch's CPU kernels use here: one instruction, several float32 lanes."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    bits = _VECTOR_BITS.get(capability, 128)  # SSE, NEON and VSX vectors are 128 bits
    return f"{capability}: {bits}-bit vectors, {bits // 32} float32 lanes per instruction"


def gil_status() -> dict[str, Any]:
    """Is this a free-threaded build (PEP 703), and is the GIL on right now?"""
    return {
        "python": sys.version.split()[0],
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        # Python < 3.13 has no _is_gil_enabled: the GIL is always on there.
        "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)(),
    }


def machine_rows() -> list[dict[str, Any]]:
    """The machine table of notebook 01: cores, SMT, SIMD, GPUs, the interpreter and its GIL."""
    from helpers.dist import gpu_count

    logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    status = gil_status()
    return [
        {"item": "logical cores this process may use", "value": available_cores()},
        {"item": "logical / physical cores in the machine", "value": f"{logical} / {physical}"},
        {"item": "SMT (from those two counts)", "value": smt_summary(logical, physical)},
        {"item": "CPU-bound workers that can run side by side", "value": compute_cores()},
        {"item": "SIMD in torch's CPU kernels", "value": simd_summary()},
        {"item": "GPUs visible", "value": gpu_count()},
        {"item": "Python", "value": status["python"]},
        {"item": "free-threaded build (PEP 703)", "value": status["free_threaded_build"]},
        {"item": "GIL enabled now", "value": status["gil_enabled"]},
        {"item": "torch intra-op threads", "value": torch.get_num_threads()},
    ]


# --- processes: how they start, and how a function reaches one ------------------------------------

def worker_context() -> multiprocessing.context.BaseContext:
    """How new worker processes start: quickly and safely.

    Not `fork`: forking a process that already runs threads (a notebook kernel, torch's OpenMP
    pool) can deadlock the child, and Python 3.14 stopped using it by default. `forkserver` forks
    each worker from a clean server process; preloading torch there makes a worker start in
    milliseconds instead of importing torch (~1.5 s) again. `spawn` where forkserver is missing.
    The function and the items travel to the workers pickled, functions by module and name, so a
    worker must be able to import them: top-level functions of a module, not of a notebook.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch"])  # only takes effect before the server starts
        return context
    return multiprocessing.get_context("spawn")


def creation_cost(kind: str, count: int = 5) -> float:
    """Median seconds to start and join one thread or one process that does nothing."""
    if kind == "thread":
        make = lambda: threading.Thread(target=int)
    elif kind == "process":
        context = worker_context()  # the start method parallel_map's process pools use
        make = lambda: context.Process(target=int)
    else:
        raise ValueError(f"kind must be 'thread' or 'process', got {kind!r}")

    def start_and_join() -> None:
        worker = make()
        worker.start()
        worker.join()

    # warmup=1: the forkserver starts once per session; keep that out of the per-process cost
    return measure(start_and_join, warmup=1, repeats=count).median


_LOAD_IN_A_FRESH_PROCESS = """\
import pickle, sys
sys.path.insert(0, sys.argv[1])
for name, data in pickle.loads(sys.stdin.buffer.read()):
    try:
        pickle.loads(data)
        print(f"{name}\\tfound")
    except Exception as exc:
        print(f"{name}\\t{type(exc).__name__}: {str(exc).splitlines()[0]}")
"""


def send_to_a_fresh_process(*functions: Callable[..., Any], timeout: float = 120.0) -> list[dict]:
    """Pickle each function here and unpickle it in a new Python, as a process pool's worker does.

    A function pickles *by reference*: the bytes name its module and its qualified name, and the
    receiving process imports the module to find it. One bounded subprocess (no pool, so nothing
    can hang), started in the repository root so that `labs` is importable there. One row per
    function: its module and name, the pickle's size, and what the fresh process found."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pickles = [(f.__qualname__, pickle.dumps(f)) for f in functions]
    done = subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, root],
                          input=pickle.dumps(pickles), capture_output=True, timeout=timeout,
                          cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"the fresh process failed: {done.stderr.decode()[-500:]}")
    outcomes = dict(line.split("\t", 1) for line in done.stdout.decode().splitlines())
    return [{"function": f.__qualname__, "pickled as": f"{f.__module__}.{f.__qualname__}",
             "bytes": len(data), "in a fresh process": outcomes[name]}
            for f, (name, data) in zip(functions, pickles)]


def main() -> None:
    from helpers.show import table
    with distributed() as ctx:
        if ctx.rank != 0:
            return  # one machine report is enough
        table(machine_rows(), title="This machine")
        table(scale_of_a_large_run(), title="A 1-trillion-parameter model against one GPU "
                                            "(Narayanan et al. 2021, arXiv:2104.04473)")
        ctx.report(machine=machine_rows(), scale=scale_of_a_large_run())


if __name__ == "__main__":
    main()
