"""Lab 02 (readings): what notebook 02 concludes from lab02_dp_costs' measurements, and its
plots (a library; lab02_dp_costs re-exports these names). Each verdict is tested both ways in
tests/test_lab02_data_parallel.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficGrowth:
    """How replica 0's traffic grows with N, from traffic_vs_replicas' first multi-replica row
    to its last, in units of C (the parameter bytes), beside a ring all-reduce's per device."""
    C: int
    n_first: int
    n_last: int
    sent_per_replica: float      # bytes replica 0 sends more per extra replica, / C
    received_per_replica: float  # and receives
    ring_first: float            # a ring's 2(N-1)/N per device at n_first and n_last, / C
    ring_last: float

    def sentence(self) -> str:
        grows = ("grows with N" if min(self.sent_per_replica, self.received_per_replica) > 0.5 else
                 "does not grow with N")
        return (f"measured: each extra replica adds {self.sent_per_replica:.2f}·C to what replica 0 sends "
                f"and {self.received_per_replica:.2f}·C to what it receives (its traffic {grows}); over "
                f"the same N, {self.n_first} to {self.n_last}, a ring's 2·C·(N-1)/N per device goes from "
                f"{self.ring_first:.2f}·C to {self.ring_last:.2f}·C (never above 2·C)")


def traffic_growth(rows: list[dict]) -> TrafficGrowth:
    """The slopes of traffic_vs_replicas' rows (rows[0] is one replica: nothing crosses)."""
    first, last = rows[1], rows[-1]
    c, dn = rows[0]["C"], last["replicas"] - first["replicas"]
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    return TrafficGrowth(c, first["replicas"], last["replicas"], (last["sent"] - first["sent"]) / dn / c,
                         (last["received"] - first["received"]) / dn / c,
                         ring(first["replicas"]), ring(last["replicas"]))


def traffic_table(rows: list[dict]) -> list[dict]:
    mib, c = 2.0 ** -20, rows[0]["C"]
    return [{"N": r["replicas"], "sent (MiB)": mib * r["sent"], "of which parameters": mib * r["broadcast params"],
             "received (MiB)": mib * r["received"], "of which gradients": mib * r["reduce param grads"],
             "sent / C": r["sent"] / c, "received / C": r["received"] / c} for r in rows]


def plot_traffic(rows: list[dict]):
    """Bytes over replica 0's link per direction against N, with the star's and a ring's models."""
    import matplotlib.pyplot as plt
    mib, c, n = 2.0 ** -20, rows[0]["C"], [r["replicas"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(n, [mib * r["sent"] for r in rows], "o-", label="measured: replica 0 sends")
    ax.plot(n, [mib * r["received"] for r in rows], "s--", label="measured: replica 0 receives")
    ax.plot(n, [mib * c * (k - 1) for k in n], ":", color="black", label="star model: C·(N-1)")
    ax.plot(n, [mib * 2 * c * (k - 1) / k for k in n], "-.", color="gray",
            label="ring all-reduce, each device: 2·C·(N-1)/N")
    ax.set(title="Bytes over replica 0's link per step, one direction", xlabel="replicas N",
           ylabel="MiB per direction")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def link_bytes_per_direction(param_bytes: int, num_devices: int) -> dict[str, float]:
    """Parameter and gradient bytes the busiest device's link carries in ONE direction per step.

    - "star (lecture's parameter-server model)": device 0 sends a copy to each of the N-1 others
      and receives a gradient from each: C*(N-1) each way (what ThreadDataParallel does here).
    - "nn.DataParallel with NCCL": its replicate is a coalesced broadcast and its gradient
      reduction `reduce_add` (torch/nn/parallel/_functions.py, comm.py), which NCCL pipelines
      along a ring or tree, so every link carries the tensor about once (nccl-tests: busbw = algbw
      for broadcast and reduce): C out (broadcast) and C in (reduce) per step, whatever N.
    - "DDP, ring all-reduce": 2*C*(N-1)/N each way on every link (notebook 04), and no broadcast.
    """
    c, n = param_bytes, num_devices
    return {"star (lecture's parameter-server model)": c * (n - 1),
            "nn.DataParallel with NCCL (broadcast + reduce)": c if n > 1 else 0,
            "DDP, ring all-reduce": 2 * c * (n - 1) / n}


def threads_verdict(row: dict) -> str:
    """threads_vs_serial's verdict for one model: faster or slower only when the middle half of
    the back-to-back pairs' speed-ups lies on one side of 1; otherwise the run's noise decides."""
    spread = f"x{row['speedup']:.2f}, middle half of {row['speedup_q1']:.2f}-{row['speedup_q3']:.2f}"
    if row["speedup_q1"] > 1:
        return f"{row['model']} model: 2 threads ran faster than the loop ({spread})"
    if row["speedup_q3"] < 1:
        return f"{row['model']} model: 2 threads ran slower than the loop ({spread})"
    return f"{row['model']} model: 2 threads and the loop are within this run's noise ({spread})"


def stacked_bars(labels, stacks: dict[str, list[float]], *, title: str, ylabel: str,
                 reference: float | None = None, reference_label: str = "", ax=None):
    """One bar per label, split into the named stacks (a legend entry each); optional dashed line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(labels) + 3), 3.4))
    bottom = [0.0] * len(labels)
    for name, heights in stacks.items():
        ax.bar(list(labels), heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle="--", linewidth=1, label=reference_label)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax

