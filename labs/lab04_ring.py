"""Lab 04 (ring): the ring all-reduce, on paper and built by hand from point-to-point messages.

Run:  ./run.sh 04      (this file alone: ./run.sh labs/lab04_ring.py)

- `ring_chunks(N, r, s)`: the ring's schedule, the one definition in the course: which chunk rank
  r sends to rank r+1 and which it receives from rank r-1 at step s (0-based, 2(N-1) steps: N-1
  of reduce-scatter, then N-1 of all-gather; Patarasuk and Yuan 2009, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations").
- `ring_state(N, k)`: that schedule simulated on paper (which terms each rank's copy of each chunk
  holds after k steps), drawn by `draw_ring_state`; the notebook's step-by-step widget.
- `ring_all_reduce`: the homework. `ring_check` compares it with `dist.all_reduce` on whole numbers
  (exactly) and on random floats (to rounding, and bit for bit across ranks).

Homework: `ring_all_reduce` below. Check it with `./run.sh check 04`
(the public tests: tests/public/test_lab04_collectives.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table


# ============================================================================ the schedule
def ring_chunks(world_size: int, rank: int, step: int) -> tuple[int, int]:
    """(chunk `rank` sends to rank + 1, chunk it receives from rank - 1) at `step` (0-based).

    Steps 0 .. N-2 are the reduce-scatter (the received chunk is added to this rank's copy),
    steps N-1 .. 2N-3 the all-gather (the received chunk, complete, replaces this rank's copy).
    Rank r always receives the chunk rank r - 1 sends, which is (sent chunk - 1) % N."""
    n = world_size
    if not 0 <= step < 2 * (n - 1):
        raise ValueError(f"step must be in 0..{2 * (n - 1) - 1} for {n} ranks, got {step}")
    if step < n - 1:                              # reduce-scatter: chunk r - s
        send = (rank - step) % n
    else:                                         # all-gather: chunk r + 1 - (s - (N-1))
        send = (rank + 1 - (step - (n - 1))) % n
    return send, (send - 1) % n


@dataclass(frozen=True)
class RingState:
    """The ring all-reduce after `step` of its 2(N-1) steps (step 0: before the first)."""
    world_size: int
    step: int
    phase: str                        # the phase `step` belonged to: start, reduce-scatter, all-gather
    sends: tuple[int | None, ...]     # sends[r]: chunk rank r sent to rank r+1 in this step
    receives: tuple[int | None, ...]  # receives[r]: chunk rank r got from rank r-1 in this step
    holds: tuple[tuple[tuple[int, ...], ...], ...]  # holds[r][c]: ranks summed in r's chunk c

    @property
    def total_steps(self) -> int:
        return 2 * (self.world_size - 1)

    def complete(self, rank: int, chunk: int) -> bool:
        return len(self.holds[rank][chunk]) == self.world_size


def ring_state(world_size: int, step: int) -> RingState:
    """Run the first `step` steps of `ring_chunks`' schedule on paper and say what every rank holds.

    Each rank starts with its own term in every chunk. A reduce-scatter step adds the incoming
    chunk's terms to the receiver's copy (never the same rank's term twice); an all-gather step
    replaces the receiver's copy with the sender's complete one.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= step <= 2 * (world_size - 1):
        raise ValueError(f"step must be in 0..{2 * (world_size - 1)} for {world_size} ranks, got {step}")
    n = world_size
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    sends: list[int | None] = [None] * n
    receives: list[int | None] = [None] * n
    for s in range(step):
        sends, receives = (list(x) for x in zip(*(ring_chunks(n, r, s) for r in range(n))))
        outgoing = [holds[r][sends[r]] for r in range(n)]  # everyone sends at once, then receives
        for r in range(n):
            incoming, chunk = outgoing[(r - 1) % n], receives[r]
            if s < n - 1:
                if incoming & holds[r][chunk]:
                    raise AssertionError(f"step {s}: rank {r} would add a term twice")
                holds[r][chunk] = holds[r][chunk] | incoming
            else:
                holds[r][chunk] = incoming
    phase = "start" if step == 0 else "reduce-scatter" if step <= n - 1 else "all-gather"
    return RingState(n, step, phase, tuple(sends), tuple(receives),
                     tuple(tuple(tuple(sorted(h)) for h in row) for row in holds))


def _terms(state: RingState, rank: int, chunk: int) -> str:
    terms = state.holds[rank][chunk]
    return "SUM" if len(terms) == state.world_size else "+".join(f"x{t}" for t in terms)


def ring_state_rows(state: RingState) -> list[dict]:
    """A table of the state: one row per rank, one column per chunk ('SUM' when complete,
    ' *' on the chunk that just arrived)."""
    rows = []
    n = state.world_size
    for r in range(n):
        sent, got = state.sends[r], state.receives[r]
        row = {"rank": r,
               "sends": "-" if sent is None else f"chunk {sent} -> rank {(r + 1) % n}",
               "receives": "-" if got is None else f"chunk {got} <- rank {(r - 1) % n}"}
        for c in range(n):
            row[f"chunk {c}"] = _terms(state, r, c) + (" *" if c == got else "")
        rows.append(row)
    return rows


def draw_ring_state(state: RingState, ax=None):
    """The state as a ranks x chunks grid: shade = share of the N terms summed in that copy,
    text = the terms ('SUM' when complete), a black frame = the chunk that just arrived."""
    import matplotlib.pyplot as plt

    n = state.world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * n + 1.5, 0.8 * n + 1))
    share = [[len(state.holds[r][c]) / n for c in range(n)] for r in range(n)]
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1.25)
    for r in range(n):
        for c in range(n):
            ax.text(c, r, _terms(state, r, c), ha="center", va="center", fontsize=8)
        if state.receives[r] is not None:
            ax.add_patch(plt.Rectangle((state.receives[r] - 0.5, r - 0.5), 1, 1, fill=False, lw=2))
    ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=8)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_xlabel("chunk of the tensor (K/N bytes each)", fontsize=8)
    ax.set_ylabel("rank", fontsize=8)
    ax.set_title(f"N={n}, step {state.step}/{state.total_steps} ({state.phase})", fontsize=9)
    return ax


# ============================================================================ the homework
def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` (default: all ranks), in place, with a ring.

    Exercise. Use only point-to-point operations (dist.isend / dist.irecv, dist.P2POp with
    dist.batch_isend_irecv, or dist.send / dist.recv), and only two peers: send to the next rank
    of the group, (rank + 1) % N, and receive from the previous one, (rank - 1) % N, where rank
    and N are this process's rank in `group` and the group's size. Convert group ranks to the
    global ranks that isend/irecv/P2POp take with dist.get_global_rank(group or dist.group.WORLD, r)
    (they take global ranks with or without group=; the messages may go through `group` or the
    default group, the tests count them either way).

    Algorithm (N ranks, K bytes): view the tensor as one flat vector and split it into N chunks,
    `tensor.view(-1).tensor_split(N)` (views; sizes differ by at most one element; some are empty
    when the tensor has fewer than N elements). Then 2(N-1) steps; at step s (0-based) this rank
    sends chunk `send` and receives chunk `recv`, where `send, recv = ring_chunks(N, rank, s)`:
      1. Reduce-scatter, steps 0 .. N-2: receive into a scratch buffer and add it to this rank's
         copy of chunk `recv`. Afterwards rank r holds the complete sum of chunk (r + 1) % N.
      2. All-gather, steps N-1 .. 2N-3: receive the complete chunk `recv` straight into place
         (no addition).
    Post each step's send and receive together (batch_isend_irecv, or isend + irecv and then wait
    on both): if every rank did a blocking send first, they would all wait for a receive.
    Skip empty chunks on both sides (sender and receiver compute the same chunk sizes).

    Returns `tensor` itself (same object, same storage), now holding the sum. The tensor is
    contiguous, of any shape, any length (0 included) and any integer or floating dtype; with
    N == 1 nothing is sent.

    Every rank must end with bitwise-identical values, as dist.all_reduce's ranks do (replicas
    that drift apart by one bit no longer train the same model): each chunk's sum is added up once,
    on one rank, and only copied in the all-gather phase. Float addition is not associative, so a
    sum formed anywhere in another order differs in the last bits.

    The tests check: the result equals dist.all_reduce's (exactly for whole numbers, to float
    rounding for random floats) and is bitwise identical on every rank, for world sizes 1 to 4
    and for sub-groups; every message goes to the next rank and comes from the previous one; each
    rank sends 2(N-1)/N of the tensor's bytes (exactly when N divides the length; at most 2(N-1)
    chunks of ceil(length / N) elements otherwise, and 2(N-1) times the tensor's bytes over all
    ranks); no built-in collective is used.
    """
    ### BEGIN SOLUTION
    ring_size = dist.get_world_size(group)
    if ring_size == 1 or tensor.numel() == 0:
        return tensor  # nothing to add up, nothing to send
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works on views of the tensor: pass a contiguous tensor")
    ring_rank = dist.get_rank(group)
    members = group if group is not None else dist.group.WORLD
    next_rank = dist.get_global_rank(members, (ring_rank + 1) % ring_size)  # we only send to it
    prev_rank = dist.get_global_rank(members, (ring_rank - 1) % ring_size)  # we only receive from it
    chunks = tensor.view(-1).tensor_split(ring_size)  # N views into `tensor`, about (K/N,) each
    inbox = torch.empty_like(chunks[0])  # the largest chunk: one scratch buffer for every step

    def exchange(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        # send and receive posted together: no rank blocks in a send nobody has received yet
        ops = []
        if outgoing.numel():
            ops.append(dist.P2POp(dist.isend, outgoing, next_rank, group))
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, prev_rank, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for step in range(2 * (ring_size - 1)):
        send, recv = ring_chunks(ring_size, ring_rank, step)
        if step < ring_size - 1:  # reduce-scatter: add the previous rank's partial sum to ours
            incoming = inbox[: chunks[recv].numel()]
            exchange(chunks[send], incoming)
            chunks[recv].add_(incoming)  # in place, into the tensor itself
        else:  # all-gather: a complete chunk lands straight in place, copied bit for bit
            exchange(chunks[send], chunks[recv])
    return tensor  # the caller's tensor, now holding the sum
    ### END SOLUTION


# ============================================================================ checks
def ring_unsolved(device: torch.device) -> dict | None:
    """None when `ring_all_reduce` is written; while it is still the exercise stub, the
    `attempt(...)` record ({"unsolved": message}) the notebook turns into a notice. Call it on
    every rank of the world before any part that needs the ring: the stub raises on every rank
    alike, before any message moves, so every rank takes the same branch afterwards."""
    probe = attempt(ring_all_reduce, torch.zeros(dist.get_world_size(), device=device))
    return probe if isinstance(probe, dict) else None


def ring_check(device: torch.device, numel: int, group=None) -> dict:
    """`ring_all_reduce` against `dist.all_reduce` on this rank's inputs: int64 whole numbers must
    match exactly; random float32 to rounding, and every rank must hold the same bits."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(1234 + rank)
    out = {}
    for name, x in (("int64", torch.randint(-1000, 1000, (numel,), generator=generator)),
                    ("float32", torch.randn(numel, generator=generator))):
        x = x.to(device)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        result = ring_all_reduce(x, group=group)
        copies = [torch.empty_like(x) for _ in range(world_size)]  # every rank's result, to compare bits
        dist.all_gather(copies, x, group=group)
        out[name] = {"same_object": result is x,
                     "max_abs_diff": (x - expected).abs().max().item() if numel else 0.0,
                     "identical_on_every_rank": all(torch.equal(c, copies[0]) for c in copies)}
    return out


@dataclass(frozen=True)
class Run(runs.Run):
    """Elements of the tensors the ring is checked on (odd: the chunks are uneven)."""
    check_numel: int = 1_000_003
    SMOKE = dict(check_numel=1_003)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Check the ring against dist.all_reduce (or report that it is not written yet)."""
    return ring_unsolved(ctx.device) or ring_check(ctx.device, numel=cfg.check_numel)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        state = ring_state(ctx.world_size, ctx.world_size - 1)
        if ctx.rank == 0:
            table(ring_state_rows(state), title=f"the ring on {ctx.world_size} ranks after its "
                  f"reduce-scatter ({state.step} of {state.total_steps} steps)")
        check = run(ctx, cfg)
        if ctx.rank == 0 and "unsolved" not in check:
            table([{"dtype": name, "max |ring - all_reduce|": c["max_abs_diff"],
                    "bitwise identical on every rank": c["identical_on_every_rank"],
                    "returned the input": c["same_object"]} for name, c in check.items()],
                  title="ring_all_reduce vs dist.all_reduce")
        ctx.report(check=check)


if __name__ == "__main__":
    main()
