"""Communication, timed as NCCL reports it (what a process sends is counted in helpers.comm_count).

Used by notebooks 03, 04 and 09 and their labs and tests:

- `sweep()`: times collectives over message sizes (warm-up, synchronize, barrier, median of
  several runs, the slowest rank's time) and reports algorithm and bus bandwidth as nccl-tests
  defines them (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):

      algbw = S / t               S: the collective's size in bytes (see SIZE CONVENTION below)
      busbw = algbw * factor      factor: 2(n-1)/n all-reduce, (n-1)/n all-gather and
                                  reduce-scatter, 1 broadcast (n ranks)

  busbw is the rate each rank's link must carry for a bandwidth-optimal (ring) algorithm to
  finish in time t; it does not depend on n, so it can be compared with the hardware's link speed.
  `side_by_side()` races a few cases at one size in alternating rounds (fair ratios on a noisy
  machine; each row also carries the busbw of its slower and faster quartile rounds, the run's
  noise); `NEIGHBOUR_EXCHANGE` is the raw link under a ring, send/recv of its chunk S/n between the
  same neighbours (busbw = algbw), to race beside an all-reduce; `fit_latency_bandwidth()` fits
  t(S) = latency + S / bandwidth (`all_reduce_fit()` sweeps the all-reduce and fits it); `fit_call_costs()` splits what small calls cost into a
  fixed cost per call and a latency per ring step; `machine_limit()` measures what one process can copy (local
  memory on the CPU; on GPUs the device copy, and the GPU-to-GPU copy when there are two).
  `LINK_BYTES_PER_S`: vendors' link speeds, per direction (the unit busbw is in).

SIZE CONVENTION (as nccl-tests): all-reduce and broadcast: the tensor; all-gather: the gathered
output (n times each rank's input); reduce-scatter: the input (n times each rank's output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from helpers.bench import Timing, measure
from helpers.comm_count import RING_SHARE
from helpers.dist import gpu_count, synchronize

KiB = 1024
MiB = 1024 * 1024

# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single in torch 2.13 (the old names
# warn); torch 2.11 only has the old ones. Take whichever this torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- quoted hardware
# Bandwidths vendors quote, in bytes/s, the ceilings to hold a measured busbw against. busbw is
# what each rank sends (and receives) per second: ONE direction. So links are listed per direction:
# NVLink's famous 900 GB/s per H100 counts both directions together.
H100_HBM_BYTES_PER_S = 3.35e12   # H100 SXM5, HBM3 (NVIDIA H100 datasheet; 3.9 TB/s on the H100 NVL)
LINK_BYTES_PER_S = {             # per direction
    # 18 NVLink 4.0 links x 25 GB/s each way (NVIDIA H100 datasheet: "900 GB/s" = both ways)
    "NVLink 4.0, H100 (900 GB/s both ways)": 450e9,
    # the lecture's figure: 128 GT/s x 16 lanes = 256 GB/s raw, ~242 GB/s after the 256-byte FLIT's
    # CRC and FEC (PCI-SIG PCIe 7.0 specification, 2025); no shipping GPU has it yet
    "PCIe 7.0 x16 (lecture's figure, no GPU yet)": 242e9,
    # the H100's host link: 32 GT/s x 16 lanes x 128/130 encoding = 63 GB/s each way
    "PCIe 5.0 x16 (H100)": 63e9,
    "InfiniBand NDR 400 Gb/s (one NIC per GPU)": 50e9,
    "Ethernet 100 Gb/s": 12.5e9,
}


# ----------------------------------------------------------------------------- bus bandwidth
# The ring's bytes sent per rank per byte of size; broadcast's factor is 1 by nccl-tests' choice
# (its ring sends (n-1)/n, but every rank must receive the whole tensor).
BUS_FACTORS: dict[str, Callable[[int], float]] = {**RING_SHARE, "broadcast": lambda n: 1.0,
                                                  "sendrecv": lambda n: 1.0}


def bus_factor(kind: str, world_size: int) -> float:
    """busbw / algbw for a collective of this kind on `world_size` ranks (nccl-tests' factors)."""
    if kind not in BUS_FACTORS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {sorted(BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return BUS_FACTORS[kind](world_size)


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the collective's size over its time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return size_bytes / seconds


def busbw(kind: str, size_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw times the kind's factor."""
    return algbw(size_bytes, seconds) * bus_factor(kind, world_size)


def lecture_bandwidth(sent_bytes_all_ranks: float, world_size: int, seconds: float) -> float:
    """The lecture's `sent_bytes / (world_size * duration)`: bytes sent per rank per second,
    averaged over ranks, for the bytes some algorithm actually (or supposedly) sent."""
    return sent_bytes_all_ranks / (world_size * seconds)


# ----------------------------------------------------------------------------- timing sweep
@dataclass(frozen=True)
class Case:
    """One thing to time: `build(numel, device, group)` allocates buffers once and returns
    (op, size_bytes) where op() runs the collective once and size_bytes follows nccl-tests."""
    name: str
    kind: str  # a key of BUS_FACTORS
    build: Callable[[int, torch.device, object], tuple[Callable[[], object], int]]


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _build_all_reduce(numel, device, group):
    # zeros: repeated sums stay finite, and adding zeros costs the same as adding anything else
    x = torch.zeros(numel, device=device)
    return (lambda: dist.all_reduce(x, group=group)), x.nbytes


def _build_all_gather(numel, device, group):
    n = _world(group)
    per_rank = max(1, numel // n)
    inp = torch.zeros(per_rank, device=device)
    out = torch.empty(per_rank * n, device=device)
    return (lambda: all_gather_single(out, inp, group=group)), out.nbytes


def _build_reduce_scatter(numel, device, group):
    n = _world(group)
    per_rank = max(1, numel // n)
    inp = torch.zeros(per_rank * n, device=device)
    out = torch.empty(per_rank, device=device)
    return (lambda: reduce_scatter_single(out, inp, group=group)), inp.nbytes


def _build_broadcast(numel, device, group):
    x = torch.zeros(numel, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return (lambda: dist.broadcast(x, src=src, group=group)), x.nbytes


BUILTIN_CASES = (
    Case("all_reduce", "all_reduce", _build_all_reduce),
    Case("all_gather", "all_gather", _build_all_gather),
    Case("reduce_scatter", "reduce_scatter", _build_reduce_scatter),
    Case("broadcast", "broadcast", _build_broadcast),
)


def _build_neighbour_exchange(numel, device, group):
    # The ring's own link pattern: every rank sends a chunk to the next rank and receives one from
    # the previous, both posted at once. S is the chunk, what one rank sends: busbw = algbw.
    n = _world(group)
    if n < 2:
        raise ValueError("a neighbour exchange needs at least 2 ranks")
    me = dist.get_rank(group)
    right, left = (dist.get_global_rank(group, (me + k) % n) if group is not None else (me + k) % n
                   for k in (1, -1))
    send = torch.zeros(max(1, numel // n), device=device)
    recv = torch.empty_like(send)

    def op():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    return op, send.nbytes


# The raw link under a ring of the same size S: send/recv of its chunk, S/n, between the same
# neighbours (not in BUILTIN_CASES: side_by_side races it beside an all-reduce of size S).
NEIGHBOUR_EXCHANGE = Case("send/recv (ring's chunk)", "sendrecv", _build_neighbour_exchange)


def all_reduce_case(name: str, fn: Callable[..., object]) -> Case:
    """A Case for a hand-written all-reduce `fn(tensor, group=group)` (e.g. our ring)."""
    def build(numel, device, group):
        x = torch.zeros(numel, device=device)
        return (lambda: fn(x, group=group)), x.nbytes
    return Case(name, "all_reduce", build)


def default_sizes(smoke: bool) -> list[int]:
    """Bytes per collective: 4 B (one float32) .. 64 MiB by factors of 4 (smoke: 4 B, 4 KiB,
    256 KiB, 4 MiB). The latency term of t = latency + S / bandwidth only shows in messages of a
    few bytes, the bandwidth term only in messages of MiB: a fit needs both ends."""
    if smoke:
        return [4, 4 * KiB, 256 * KiB, 4 * MiB]
    return [4 * 4 ** i for i in range(13)]  # 4 B, 16 B, ..., 16 MiB, 64 MiB


def calls_per_sample(size_bytes: int, target_bytes: int = 4 * MiB, most: int = 50) -> int:
    """Small messages take microseconds, below the clock's noise: time a batch of calls per
    sample (nccl-tests does the same). Depends only on the size, so every rank agrees."""
    return max(1, min(most, target_bytes // max(1, size_bytes)))


def slowest(seconds: float, device: torch.device, group=None) -> float:
    """The largest of every rank's value: a collective finishes when its slowest rank does."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_case(case: Case, size_bytes: int, *, device: torch.device, group=None, warmup: int = 2,
              repeats: int = 5, element_size: int = 4) -> dict:
    """Median seconds per call of `case` at about `size_bytes` (the slowest rank's median).

    The row's "size" is `size_bytes` as asked; "bytes" is nccl-tests' S for the buffers built,
    which for all-gather and reduce-scatter rounds to a whole number of elements per rank."""
    op, actual_bytes = case.build(max(1, size_bytes // element_size), torch.device(device), group)
    calls = calls_per_sample(actual_bytes)

    def batch():
        for _ in range(calls):
            op()

    timing = measure(batch, warmup=warmup, repeats=repeats, device=device, barrier=True)
    seconds = slowest(timing.median / calls, torch.device(device), group)
    n = _world(group)
    return {"op": case.name, "kind": case.kind, "size": size_bytes, "bytes": actual_bytes,
            "seconds": seconds, "algbw_GBps": algbw(actual_bytes, seconds) / 1e9,
            "busbw_GBps": busbw(case.kind, actual_bytes, seconds, n) / 1e9,
            "calls_per_sample": calls, "repeats": repeats}


def sweep(cases: Sequence[Case], sizes: Sequence[int], *, device: torch.device, group=None,
          warmup: int = 2, repeats: int = 5) -> list[dict]:
    """Rows of `time_case` for every size and case. Cases alternate within a size, so a burst of
    noise on a shared machine hits all of them rather than one."""
    rows = []
    for size in sizes:
        for case in cases:
            rows.append(time_case(case, size, device=device, group=group, warmup=warmup,
                                  repeats=repeats))
    return rows


def side_by_side(cases: Sequence[Case], size_bytes: int, *, device: torch.device, group=None,
                 rounds: int = 7, warmup: int = 2) -> list[dict]:
    """Time several cases at one size in alternating rounds (A B C, A B C, ...) and take each
    one's median (the slowest rank's): drifting load on a shared machine then hits all of them
    alike, so their ratio is fairer than two separate sweeps'."""
    device = torch.device(device)
    built = [case.build(max(1, size_bytes // 4), device, group) for case in cases]
    calls = [calls_per_sample(size) for _, size in built]
    samples: list[list[float]] = [[] for _ in cases]
    for i in range(warmup + rounds):
        for j, ((op, _), k) in enumerate(zip(built, calls)):
            def batch(op=op, k=k):
                for _ in range(k):
                    op()
            t = measure(batch, warmup=0, repeats=1, device=device, barrier=True).median / k
            if i >= warmup:
                samples[j].append(t)
    n = _world(group)
    rows = []
    for case, (_, size), times in zip(cases, built, samples):
        seconds = slowest(Timing(tuple(times)).median, device, group)
        ordered = sorted(times)  # the middle half of the rounds: the run's own noise
        q1, q3 = (slowest(ordered[i], device, group) for i in (len(ordered) // 4, (3 * len(ordered)) // 4))
        rows.append({"op": case.name, "kind": case.kind, "size": size_bytes, "bytes": size,
                     "seconds": seconds, "algbw_GBps": algbw(size, seconds) / 1e9,
                     "busbw_GBps": busbw(case.kind, size, seconds, n) / 1e9, "rounds": rounds,
                     "busbw_q1_GBps": busbw(case.kind, size, q3, n) / 1e9,   # slower rounds, less busbw
                     "busbw_q3_GBps": busbw(case.kind, size, q1, n) / 1e9})
    return rows


# ----------------------------------------------------------------------------- model and limits
def fit_latency_bandwidth(sizes_bytes: Sequence[float],
                          seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t(S) = latency + S / bandwidth; return (latency_s, bandwidth_bytes_per_s).

    Least squares on relative error (each equation divided by its measured t), so the
    microsecond-scale small sizes count as much as the large ones; ordinary least squares would
    let the largest size decide everything and leave the latency meaningless.
    """
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError("need at least two (size, seconds) pairs of equal length")
    s = torch.tensor(sizes_bytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    if (t <= 0).any():
        raise ValueError("seconds must be positive")
    a = torch.stack([1 / t, s / t], dim=1)  # rows: (1 / t_i, S_i / t_i) . (latency, 1/bw) = 1
    solution = torch.linalg.lstsq(a, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
    latency, inverse_bandwidth = solution.tolist()
    if inverse_bandwidth <= 0:
        raise ValueError("the fit gave a non-positive inverse bandwidth: times do not grow with size")
    return latency, 1.0 / inverse_bandwidth


def all_reduce_fit(sizes_bytes: Sequence[int], *, device: torch.device, group=None,
                   repeats: int = 5, attempts: int = 3) -> tuple[float, float, list[dict]]:
    """Time the all-reduce at each size and fit t(S) = latency + S / algbw; returns (latency_s,
    algbw_bytes_per_s, rows). Every rank gets the same rows (each time is the slowest rank's),
    so every rank takes the same decision below.

    On a loaded machine a burst of noise can make a larger all-reduce look no slower than a
    smaller one; the sweep is then repeated (with twice the repeats) rather than failing."""
    case = next(c for c in BUILTIN_CASES if c.name == "all_reduce")
    for attempt in range(attempts):
        rows = sweep([case], sizes_bytes, device=device, group=group, warmup=1,
                     repeats=repeats * 2 ** attempt)
        try:
            latency, algbw_ = fit_latency_bandwidth([r["bytes"] for r in rows],
                                                    [r["seconds"] for r in rows])
            return latency, algbw_, rows
        except ValueError:
            if attempt == attempts - 1:
                raise ValueError(f"all-reduce times did not grow with size in {attempts} sweeps "
                                 f"(the machine is very busy?): {[r['seconds'] for r in rows]}")


def fit_call_costs(rows: Sequence[dict]) -> tuple[float, float]:
    """Fit what small collectives cost as call_s per call + step_s per ring step; return
    (call_s, step_s), both >= 0.

    Each row is one timed run of several small calls: "calls" (how many), "steps" (their ring
    steps added up: 2(n-1) per all-reduce, n-1 per all-gather...) and "seconds" (what they took
    beyond the same run without them): seconds = calls call_s + steps step_s. Ordinary least
    squares on the seconds: the runs are of similar lengths, and the ones with the most calls,
    which weigh most in a training step, count the most. Where a coefficient comes out negative
    it is set to 0 and the other refitted alone."""
    rows = [r for r in rows if r["calls"] > 0]
    if not rows:
        raise ValueError("no row with at least one call to fit")
    a = torch.tensor([[r["calls"], r["steps"]] for r in rows], dtype=torch.float64)
    b = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)

    def alone(col: int) -> float:          # b ~ a[:, col] x, least squares, x >= 0
        norm = float(a[:, col] @ a[:, col])
        return max(0.0, float(a[:, col] @ b) / norm) if norm > 0 else 0.0

    if torch.linalg.matrix_rank(a) == 2:
        call_s, step_s = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
        if call_s >= 0 and step_s >= 0:
            return call_s, step_s
        return (0.0, alone(1)) if call_s < 0 else (alone(0), 0.0)
    return alone(0), 0.0


def predict_seconds(size_bytes: float, latency_s: float, bandwidth_bytes_per_s: float) -> float:
    return latency_s + size_bytes / bandwidth_bytes_per_s


def machine_limit(device: torch.device | str, size_bytes: int = 64 * MiB,
                  repeats: int = 5) -> list[dict]:
    """What one process can move, measured here: the ceiling beside the collectives' busbw.

    CPU: copying `size_bytes` from one preallocated buffer to another (gloo between processes on
    one machine goes through the kernel's socket buffers: at least two such copies per byte).
    CUDA: a copy within this GPU (its memory bandwidth), and when two GPUs are visible, a copy
    from GPU 0 to GPU 1 (the interconnect: NVLink or PCIe; `nvidia-smi topo -m` says which).
    Bandwidth is bytes copied per second (each byte is read once and written once).
    """
    device = torch.device(device)
    numel = size_bytes // 4
    rows = []

    def copy_rate(src, dst, what):
        t = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=dst.device)
        synchronize(src.device)
        rows.append({"limit": what, "bytes": size_bytes, "seconds": t.median,
                     "GBps": size_bytes / t.median / 1e9})

    if device.type == "cuda":
        src = torch.zeros(numel, device=device)
        copy_rate(src, torch.empty_like(src), f"copy within {device} (GPU memory)")
        if gpu_count() >= 2:
            a = torch.zeros(numel, device="cuda:0")
            copy_rate(a, torch.empty(numel, device="cuda:1"), "copy cuda:0 -> cuda:1 (interconnect)")
    else:
        src = torch.zeros(numel)
        copy_rate(src, torch.empty_like(src), "local memory copy (one CPU process)")
    return rows
