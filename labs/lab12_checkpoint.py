"""Lab 12's checkpoints: sharded checkpoints with torch.distributed.checkpoint (DCP), saved and
loaded on any layout, and what is on disk. A library of lab 12 (no run of its own): lab12_train.py
writes a checkpoint at the end of its run, lab12_resume.py kills a rank, restarts and reshards.

- Saving: `get_state_dict(model, optimizer)` gives this rank's part of the model's and the
  optimizer's state, keyed by the plain model's names (FSDP's and the checkpoint wrapper's
  prefixes removed; `flatten_optimizer_state_dict=True` keys the optimizer state by parameter
  name too, so the pipeline stages' optimizers add up to one), as DTensors where they are
  sharded. `dcp.save` writes one file per rank (`__<rank>_0.distcp`: its shards, each
  replicated piece written once) and a `.metadata` file (every tensor's global shape and which
  file holds which piece), written last: a folder without it is an unfinished checkpoint.
- Loading: each rank asks for the pieces its own shards need (`dcp.load` into the state dict of
  the model as it is now laid out), so the layout that loads need not be the one that saved
  (resharding): another (pp, dp, tp) mesh, or one process (`no_dist=True`).
- Against notebook 03's way (rank 0 gathers a full `state_dict()` and saves it): rank 0 would
  hold the whole model and optimizer state in memory at once, and receive all of it.

A "trainer" here is anything with `.model` and `.optimizer` (lab12_train.Trainer).
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from helpers.dist import DistContext
from labs.lab12_model import LMConfig, build_model

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
METADATA = ".metadata"
# DCP warns each time it writes over a folder and each time one process loads alone; here both
# are meant (a rerun writes the same steps again; one_process_* load without a group on purpose)
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# ================================================================================ save and load
def save(trainer, root: Path, step: int) -> Path:
    """Every rank writes its shards of the model and optimizer state after `step` steps into
    root/step-<step>; returns that folder."""
    folder = root / f"step-{step:05d}"
    # An earlier run may have left this folder, written by more ranks: its extra files would stay
    # beside ours and be counted as this checkpoint's. Rank 0 empties it; everyone waits.
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first and folder.exists():
        shutil.rmtree(folder)
    if dist.is_initialized():
        dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=OPTIONS)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder)
    return folder


def latest(root: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint under root (one with its .metadata)."""
    found = sorted((int(p.name.split("-")[1]), p) for p in root.glob("step-*") if (p / METADATA).is_file())
    return found[-1] if found else None


def load(trainer, folder: Path) -> None:
    """Load a checkpoint into the trainer's model and optimizer, whatever layout wrote it."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=OPTIONS)


def one_process_state(folder: Path, config: LMConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The whole model and its AdamW, loaded from a checkpoint by this process alone (no
    collective: the other ranks may be doing anything)."""
    model = build_model(config, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=OPTIONS)
    return model, optimizer


def one_process_model(folder: Path, config: LMConfig) -> torch.nn.Module:
    """The whole model from a checkpoint, in this process alone (weights only)."""
    model = build_model(config, "cpu")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state["model"])
    return model


# ============================================================================ what is on disk
def files_on_disk(folder: Path) -> dict[str, int]:
    """File name -> bytes, of one checkpoint folder."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def full_state_bytes(folder: Path) -> dict[str, int]:
    """Bytes of the whole model's and optimizer's tensors, from the checkpoint's metadata (global
    shapes and dtypes): what rank 0 would hold, and receive, to save a full state_dict."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {"model": 0, "optimizer": 0}
    for key, meta in metadata.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        if size is None:    # a non-tensor entry (pickled bytes)
            continue
        nbytes = torch.Size(size).numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        out["model" if key.startswith("model.") else "optimizer"] += nbytes
    out["total"] = out["model"] + out["optimizer"]
    return out


def file_payload(folder: Path) -> dict[str, int]:
    """File name -> bytes of tensor data it holds (each piece's elements x element size), from the
    metadata: the rest of a file is serialisation overhead (about 1.5 KB per piece)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    out: dict[str, int] = {}
    for index, where in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            continue
        chunk = next(c for c in chunks if tuple(c.offsets) == tuple(index.offset or ()))
        size = torch.Size(chunk.sizes).numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        out[where.relative_path] = out.get(where.relative_path, 0) + size
    return out


def checkpoint_report(folder: Path, ctx: DistContext, trainer) -> dict:
    """The files of the checkpoint, this rank's file, and what a rank-0 full state_dict would
    need; every rank reads the (shared) folder after the save."""
    files = files_on_disk(folder)
    return {"folder": str(folder), "files": files, "payload": file_payload(folder),
            "my_file_bytes": files.get(f"__{ctx.rank}_0.distcp", 0),
            "full_state": full_state_bytes(folder), "held_by_me": trainer.held_now()}
