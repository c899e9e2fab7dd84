"""Checkpoints of a sharded trainer: every rank writes its own part with
`torch.distributed.checkpoint` (DCP), and the checkpoint appears whole or not at all.

Layout of ``checkpoints/step-N/`` (the run directory is shared by the ranks: one host, or a
shared filesystem across hosts)::

    dcp/             the model's and the optimiser's shards (DCP: one file per rank + metadata)
    rng/rank<r>.pt   rank r's torch (and CUDA) RNG states
    trainer.pt       {"format": "dcp", "world_size": N}
    trainer.json     the trainer's step count and rank 0's Python RNG
    run_state.json   the driver's state
    MANIFEST.json    size and SHA-256 of everything above (written last)

Atomic as a whole: all ranks write into one staging directory (``.tmp-step-N-sharded``), a
collective barrier proves every part is written, and only then does rank 0 write the manifest and
rename the directory to ``step-N`` (`replace_dir`, the same rename as `staged_dir`). A rank that
fails or dies before the rename leaves no ``step-N``; its debris is removed by the next write.
DCP reshards on load, so a checkpoint loads into the same sharded model at any world size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.errors import AsyncrlError
from asyncrl.rl.checkpoint import (PREFIX, RUN_STATE, TRAINER_JSON, TRAINER_TENSORS, Checkpoint, checkpoints_dir,
                                   write_manifest)
from asyncrl.runtime.files import (  # the same flush and rename as a single-rank checkpoint's
    ASIDE_PREFIX, fsync_path, fsync_tree, remove_debris, replace_dir, write_bytes)
from asyncrl.rl.trainer.checkpoint import prune, restore_rngs_and_steps, write_failure

DCP_DIR, RNG_DIR = "dcp", "rng"
FORMAT = "dcp"


class CheckpointFormatError(AsyncrlError):
    """A checkpoint written by a trainer of another kind (sharded vs single-process) than the one
    loading it; the message says which world size resumes it."""


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, DCP_DIR))


def refuse_sharded(path: str) -> None:
    """A single-process trainer cannot load a sharded checkpoint: say which world size can."""
    if is_sharded_checkpoint(path):
        with open(os.path.join(path, TRAINER_JSON)) as f:
            world_size = json.load(f).get("world_size", "N")
        raise CheckpointFormatError(f"checkpoint {os.path.basename(path)} was written by a {world_size}-rank trainer: "
                                    f"resume it with --trainer.world_size {world_size}")


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def write_sharded_checkpoint(rank: int, world_size: int, run_dir: str, step: int, keep: int, model: Any,
                             optimizer: Any, trainer_steps: int, run_state: bytes) -> str:
    """Every rank calls this together (inside the rank group's guard); returns the path on rank 0,
    "" on the others. A failed write raises `CheckpointWriteError` and leaves no ``step-N``."""
    import torch.distributed.checkpoint as dcp

    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    tmp = os.path.join(root, f".tmp-{PREFIX}{step:08d}-sharded")
    try:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            remove_debris(root)  # rank 0 is the one writer of names in checkpoints/
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, RNG_DIR))
        dist.barrier()  # the staging directory exists, empty
        dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(tmp, DCP_DIR))
        rng = {"torch_rng": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda_rng"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, RNG_DIR, f"rank{rank}.pt"))
        if rank == 0:
            torch.save({"format": FORMAT, "world_size": world_size}, os.path.join(tmp, TRAINER_TENSORS))
            version, internal, gauss = random.getstate()
            write_bytes(os.path.join(tmp, TRAINER_JSON), json.dumps(
                {"steps": trainer_steps, "python_rng": [version, list(internal), gauss], "world_size": world_size}).encode())
            write_bytes(os.path.join(tmp, RUN_STATE), run_state)
        dist.barrier()  # every rank's part is written
        if rank != 0:
            return ""
        write_manifest(tmp)
        fsync_tree(tmp)
        aside = os.path.join(os.path.dirname(final), ASIDE_PREFIX + os.path.basename(final))
        replace_dir(tmp, final, aside)
        shutil.rmtree(aside, ignore_errors=True)
        fsync_path(root)
    except Exception as exc:
        error = write_failure(f"the checkpoint of step {step}", root, exc)  # while tmp holds the space that ran out
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error from exc
    prune(run_dir, keep)
    return final


def load_sharded_checkpoint(rank: int, checkpoint: Checkpoint, model: Any, optimizer: Any) -> int:
    """Every rank calls this together: the model's and the optimiser's shards (resharded to this
    world size by DCP), this rank's RNG states and the Python RNG. Returns the trainer's steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not is_sharded_checkpoint(checkpoint.path):
        raise CheckpointFormatError(f"checkpoint {checkpoint.name} was written by a single-process trainer: "
                                    "resume it with --trainer.world_size 1")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(checkpoint.path, DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_path = os.path.join(checkpoint.path, RNG_DIR, f"rank{rank}.pt")
    if not os.path.exists(rng_path):  # written at a smaller world size: this rank starts from rank 0's
        rng_path = os.path.join(checkpoint.path, RNG_DIR, "rank0.pt")
    return restore_rngs_and_steps(checkpoint, torch.load(rng_path, map_location="cpu", weights_only=True))
