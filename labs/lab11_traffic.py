"""Lab 11 (traffic): the all-to-alls a rank issues, with their split sizes, counted at the process
group: the bytes each one sends to the other ranks (its rows for itself stay, a local copy).

A library of lab 11 (no main): labs/lab11_ulysses.py and labs/lab11_expert_check.py use it.

`record_all_to_alls()` wraps `ProcessGroup.all_to_all_single` (every route of
`dist.all_to_all_single` ends there) for the length of a block; the calls really run. It counts
what helpers.comm_count cannot yet: the bytes per destination from the split sizes. Once
helpers.traffic's TrafficMeter is in the course (it records every collective by group, with
bytes), this becomes a view of it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

from helpers.comm_count import patched


@dataclass
class AllToAllCall:
    dtype: str
    row_bytes: int                # bytes of one row (dim 0 entry) of the input
    input_splits: list[int]       # rows to each group rank (even splits filled in)
    output_splits: list[int]      # rows from each group rank
    group_rank: int
    group_size: int

    @property
    def sent_bytes(self) -> int:
        """Bytes to the other ranks (the rows kept for this rank are a local copy)."""
        return sum(s for j, s in enumerate(self.input_splits) if j != self.group_rank) * self.row_bytes



@contextlib.contextmanager
def record_all_to_alls() -> Iterator[list[AllToAllCall]]:
    """Every all_to_all_single issued inside the block, in order, with its split sizes."""
    calls: list[AllToAllCall] = []

    def make(original):
        def recorded(self, output, input, output_split_sizes, input_split_sizes, *args, **kwargs):
            n = self.size()
            rows_in, rows_out = input.shape[0] if input.dim() else 0, output.shape[0] if output.dim() else 0
            row_bytes = input.nbytes // rows_in if rows_in else input.element_size() * math.prod(input.shape[1:])
            calls.append(AllToAllCall(str(input.dtype).replace("torch.", ""), row_bytes,
                                      list(input_split_sizes) or [rows_in // n] * n,
                                      list(output_split_sizes) or [rows_out // n] * n, self.rank(), n))
            return original(self, output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
        return recorded

    with patched({"all_to_all_single": make}, required=("all_to_all_single",)):
        yield calls
