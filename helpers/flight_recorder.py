"""torch's flight recorder, read: the last collectives of every process group of this process.

    records = flight_records(group, stacks=True)   # [{"seq", "op", "sizes", "where"}, ...]

Notebook 10 compares the ranks' records to find where they parted; its mystery jobs
(helpers/mystery_jobs.py) log them for the `diagnose` exercise.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

TORCH_DIR = str(Path(torch.__file__).parent)


def flight_recorder_size() -> int:
    """The flight recorder's ring buffer size, read as torch 2.13 reads it at the process's first
    collective (torch/csrc/distributed/c10d/FlightRecorder.hpp): TORCH_FR_BUFFER_SIZE, else its
    legacy name TORCH_NCCL_TRACE_BUFFER_SIZE, else 2000; 0 switches the recorder off."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name, "").strip()
        if value:
            return int(value)
    return 2000


def flight_records(group=None, stacks: bool = False) -> list[dict]:
    """This rank's flight-recorder entries for `group` (default: the default group), oldest first.

    torch keeps one ring buffer per process of the last `flight_recorder_size()` collectives of
    all its process groups (on by default, on gloo too, in torch 2.13), each with its sequence
    number in its group, op, input sizes and the Python stack that issued it. `_dump_fr_trace` is
    what NCCL's watchdog writes to a file on a timeout; on gloo nothing dumps it for you, so call
    it where you catch the error. With `stacks`, each record also says where it was issued
    ("file:line function"); the first dump with stacks is slow (torch imports its compiler stack
    to symbolise them: seconds). Empty when the recorder is off (a buffer size of 0)."""
    if flight_recorder_size() <= 0:
        return []
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, stacks, False))
    name = (group or dist.group.WORLD).group_name
    records = []
    for entry in dump.get("entries", []):
        if entry["process_group"][0] != name:
            continue
        record = {"seq": entry["collective_seq_id"], "op": entry["profiling_name"].split(":")[-1],
                  "sizes": entry["input_sizes"]}
        if stacks:
            record["where"] = next((f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                                    for f in entry.get("frames", []) if not f["filename"].startswith(TORCH_DIR)), "?")
        records.append(record)
    return records
