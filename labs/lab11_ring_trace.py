"""Lab 11 (ring trace): what one ring attention call did, in order, recorded from outside it.

A library of lab 11 (no main): labs/lab11_ring_check.py, labs/lab11_zigzag.py and the tests use it.

`trace_ring()` records, for every process, each point-to-point post and wait (every route ends in
`ProcessGroup.send` / `recv`; the requests isend, irecv and gloo's `batch_isend_irecv` return are
wrapped to see their waits) and every `attention_block` call of labs/lab11_ring_attention.py,
with the bytes of receive buffers still alive when the block started (weak references: the trace
keeps nothing alive) and the storage each message used (a receive into a tensor whose send is
still in flight is flagged). Times are `time.perf_counter()`, CLOCK_MONOTONIC on Linux: one
clock for every process of a machine, so the ranks' traces line up (not across machines).

`forward_events` cuts a traced forward and backward at the forward's end; `send_wait_causes`
says, for the waits on sends, how much was spent before the receiving rank had posted its
receive (it was still computing: the ranks out of step) and how much after (the copy itself,
which on one machine shares the cores with the compute). `draw_timelines` plots the ranks'
forward passes on that shared clock.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import labs.lab11_ring_attention as ring
from helpers.comm_count import patched


@dataclass
class RingEvent:
    kind: str                   # "send", "recv", "wait send", "wait recv", "block"
    t: float                    # time.perf_counter() when it happened
    peer: int | None = None     # send/recv: the other end, a rank of the group used
    nbytes: int = 0             # send/recv: the message's bytes
    q_start: int = -1           # block: global positions and lengths passed to attention_block
    q_len: int = 0
    k_start: int = -1
    k_len: int = 0
    seconds: float = 0.0        # block: how long attention_block took; wait: how long it blocked
    live_recv_bytes: int = 0    # block: bytes of receive buffers still alive when it started
    into_sending: bool = False  # recv: into a storage whose send is still in flight


@dataclass
class RingTrace:
    """What one process did inside `trace_ring()`, in order."""
    events: list[RingEvent] = field(default_factory=list)

    def of(self, kind: str) -> list[RingEvent]:
        return [e for e in self.events if e.kind == kind]

    @property
    def blocks(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_len, k_start, k_len) of every attention_block call, in order."""
        return [(e.q_start, e.q_len, e.k_start, e.k_len) for e in self.of("block")]

    @property
    def work(self) -> int:
        """Score entries computed: sum of q_len * k_len over the blocks (batch and heads aside)."""
        return sum(e.q_len * e.k_len for e in self.of("block"))

    @property
    def compute_seconds(self) -> float:
        return sum(e.seconds for e in self.of("block"))

    @property
    def wait_seconds(self) -> float:
        """Seconds spent blocked in waits for receives: the transfer time the compute did not hide."""
        return sum(e.seconds for e in self.of("wait recv"))

    @property
    def live_recv_bytes(self) -> list[int]:
        """Bytes of received buffers alive at each block, in order."""
        return [e.live_recv_bytes for e in self.of("block")]

    @property
    def max_live_recv_bytes(self) -> int:
        return max(self.live_recv_bytes, default=0)

    @property
    def received_into_sending(self) -> bool:
        return any(e.into_sending for e in self.of("recv"))

    def rows(self) -> list[dict]:
        """The events as rows, "t" on the machine's clock in s, "ms" from this trace's first event."""
        t0 = self.events[0].t if self.events else 0.0
        rows = []
        for e in self.events:
            what = (f"block q@{e.q_start} x k@{e.k_start}" if e.kind == "block"
                    else f"{e.kind} {'to' if 'send' in e.kind else 'from'} {e.peer}")
            rows.append({"t": e.t, "ms": 1e3 * (e.t - t0), "event": what, "bytes": e.nbytes,
                         "lasted ms": 1e3 * e.seconds})
        return rows


class _TracedWork:
    """A request that records when it is waited on and for how long (the real one waits)."""

    def __init__(self, work, event: Callable[[], RingEvent]):
        self._work, self._event = work, event

    def wait(self, *args, **kwargs):
        event = self._event()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            event.seconds = time.perf_counter() - event.t

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def trace_ring() -> Iterator[RingTrace]:
    """Record this process's point-to-point posts and waits and every `attention_block` call of
    labs/lab11_ring_attention.py (as its functions and lab11_zigzag's see it) inside the block."""
    trace = RingTrace()
    received: dict[int, tuple[weakref.ref, int]] = {}    # storage address -> (ref, bytes)
    sending: dict[int, weakref.ref] = {}                 # storage address -> ref, until waited

    def live_bytes() -> int:
        return sum(n for ref, n in received.values() if ref() is not None)

    def make(direction: str):
        def wrap(original):
            def op(self, tensors, peer, tag=0):
                event = RingEvent(direction, time.perf_counter(), peer, sum(t.nbytes for t in tensors))
                storages = [t.untyped_storage() for t in tensors]
                for storage in storages:
                    ptr = storage.data_ptr()
                    if direction == "recv":
                        in_flight = sending.get(ptr)
                        event.into_sending |= in_flight is not None and in_flight() is not None
                        received[ptr] = (weakref.ref(storage), storage.nbytes())
                    else:
                        sending[ptr] = weakref.ref(storage)
                trace.events.append(event)
                work = original(self, tensors, peer, tag)

                def waited() -> RingEvent:
                    if direction == "send":
                        for storage in storages:
                            sending.pop(storage.data_ptr(), None)
                    trace.events.append(RingEvent(f"wait {direction}", time.perf_counter(), peer))
                    return trace.events[-1]
                return _TracedWork(work, waited)
            return op
        return wrap

    original_block = ring.attention_block

    def traced_block(q, k, v, q_start, k_start, causal, scale=None):
        event = RingEvent("block", time.perf_counter(), q_start=int(q_start), q_len=q.shape[-2],
                          k_start=int(k_start), k_len=k.shape[-2], live_recv_bytes=live_bytes())
        result = original_block(q, k, v, q_start, k_start, causal, scale)
        event.seconds = time.perf_counter() - event.t
        trace.events.append(event)
        return result

    ring.attention_block = traced_block
    try:
        with patched({"send": make("send"), "recv": make("recv")}, required=("send", "recv")):
            yield trace
    finally:
        ring.attention_block = original_block


# ============================================================================ reading a trace
def forward_events(rows: list[dict]) -> list[dict]:
    """The forward pass's rows of a trace that also holds the backward: up to the first send
    after the last block (the backward starts by posting its first K/V block)."""
    last = max((i for i, e in enumerate(rows) if e["event"].startswith("block")), default=-1)
    end = next((i for i in range(last + 1, len(rows)) if rows[i]["event"].startswith("send")), len(rows))
    return rows[:end]


@dataclass(frozen=True)
class SendWaits:
    """Waits on one rank's sends, split at the moment the receiving rank posted its receive."""
    rank: int
    waited_ms: float            # in every wait on a send
    before_peer_ms: float       # ... of which before the receiving rank had posted its receive
    posted_before_block: bool   # the first send and receive came before the first block
    verdict: str


def send_waits(rank: int, rows: list[dict], peer_rows: list[dict]) -> SendWaits:
    """How long `rank` waited for its sends, and how much of it the receiving rank (`peer_rows`:
    its forward's rows, on the same clock) had not yet posted the matching receive: the k-th
    send waits for the peer's k-th receive. A wait spent mostly before that post is the ranks
    being out of step (the receiver still computing), not the copy."""
    sends = [e for e in rows if e["event"].startswith("send")]
    send_waits_ = [e for e in rows if e["event"].startswith("wait send")]
    peer_posts = [e["t"] for e in peer_rows if e["event"].startswith("recv")]
    waited = before = 0.0
    for k, wait in enumerate(send_waits_):
        start, end = wait["t"], wait["t"] + wait["lasted ms"] / 1e3
        posted = peer_posts[k] if k < len(peer_posts) else end
        waited += end - start
        before += max(0.0, min(end, posted) - start)
    kinds = [e["event"].split(" ")[0] for e in rows]
    first_block = kinds.index("block") if "block" in kinds else len(kinds)
    posted_first = "send" in kinds[:first_block] and "recv" in kinds[:first_block]
    return SendWaits(rank, 1e3 * waited, 1e3 * before, posted_first,
                     send_wait_verdict(1e3 * waited, 1e3 * before))


def send_wait_verdict(waited_ms: float, before_peer_ms: float, floor_ms: float = 0.5) -> str:
    """Why a rank waited on its sends: "out of step" when most of the wait came before the
    receiving rank posted its receive, "copying" when most came after, "no wait" under floor_ms."""
    if waited_ms < floor_ms:
        return "no wait worth naming"
    if before_peer_ms >= 0.5 * waited_ms:
        return "out of step: the receiving rank had not posted its receive yet (still computing)"
    return "copying: the receiver was ready, the transfer itself took the time (it shares the cores)"


def draw_timelines(timelines: dict[str, list[list[dict]]]):
    """One panel per entry (e.g. "no mask", "causal"): each rank's forward on the shared clock, in
    ms from the earliest event of the panel; blocks blue, waits red (receive) or orange (send),
    posts as ticks. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ranks = len(next(iter(timelines.values())))
    fig, axes = plt.subplots(1, len(timelines), figsize=(10, 0.6 * ranks + 2.2), sharey=True, squeeze=False)
    colours = {"block": "tab:blue", "wait recv": "tab:red", "wait send": "tab:orange"}
    for ax, (title, per_rank) in zip(axes[0], timelines.items()):
        t0 = min(e["t"] for rows in per_rank for e in rows)
        for rank, rows in enumerate(per_rank):
            for e in rows:
                ms = 1e3 * (e["t"] - t0)
                kind = next((k for k in colours if e["event"].startswith(k)), None)
                if kind:
                    ax.barh(rank, e["lasted ms"], left=ms, color=colours[kind], height=0.5)
                elif e["event"].startswith(("send", "recv")):
                    ax.plot([ms], [rank + 0.35], "kv", markersize=5)
        ax.set(title=f"{title}: forward pass per rank", xlabel="ms (one clock for every rank)")
    axes[0][0].set(ylabel="rank", yticks=range(ranks))
    axes[0][0].invert_yaxis()
    fig.legend(handles=[Line2D([], [], color="black", marker="v", linestyle="", label="send / receive posted"),
                        *(Patch(color=c, label=k.replace("wait recv", "waiting for the next block")
                                .replace("wait send", "waiting for its send").replace("block", "block computed"))
                          for k, c in colours.items())], fontsize=8, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
