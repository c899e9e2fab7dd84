"""Writing and loading a resumable checkpoint in the trainer's process (it holds the model and the
optimiser), writing a policy (final, best: `write_policy`), and the one-line error of a failed
write (of a checkpoint or a policy). The directory
format, its manifest, how a directory is written whole and how checkpoints are found are in
``rl/checkpoint.py``.

A trainer's checkpoint has one of two layouts, by its world size (``trainer/parallel.py`` picks):
one process writes the Hugging Face layout (``model/``, ``trainer.pt`` with the optimiser state),
which transformers and vLLM load as it is; the N ranks of a rank group each write their shards of
the model and the optimiser with `torch.distributed.checkpoint` (DCP)::

    dcp/             the model's and the optimiser's shards (DCP: one file per rank + metadata)
    rng/rank<r>.pt   rank r's torch (and CUDA) RNG states
    trainer.pt       {"format": "dcp", "world_size": N}
    trainer.json     the trainer's step count and rank 0's Python RNG
    run_state.json   the driver's state
    MANIFEST.json    size and SHA-256 of everything above (written last)

Both are atomic as a whole. N ranks write into one staging directory (``.tmp-step-N-sharded``), a
collective barrier proves every part is written, and only then does rank 0 write the manifest and
rename the directory to ``step-N`` (`replace_dir`, the same rename as `staged_dir`). A rank that
fails or dies before the rename leaves no ``step-N``; its debris is removed by the next write (the
run directory is shared by the ranks: one host, or a shared filesystem across hosts). DCP
reshards on load, so a sharded checkpoint loads at any world size > 1.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.errors import AsyncrlError
from asyncrl.rl.checkpoint import (
    MODEL_DIR,
    PREFIX,
    RUN_STATE,
    TRAINER_JSON,
    TRAINER_TENSORS,
    Checkpoint,
    CheckpointWriteError,
    checkpoints_dir,
    list_checkpoints,
    write_manifest,
    write_reason,
)
from asyncrl.runtime.files import (  # the same flush and rename for either layout
    ASIDE_PREFIX,
    fsync_path,
    fsync_tree,
    remove_debris,
    remove_dir,
    replace_dir,
    staged_dir,
    write_bytes,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

STALL_ENV = "ASYNCRL_TEST_STALL_CHECKPOINT_STEP"
"""Test-only: the trainer stalls (60 s) while writing the checkpoint of this step, after the model
files and before the rest, so a test can kill it mid-write. Never set it in a real run."""
ADAPTER_DIR = "adapter"
"""With LoRA, a saved policy (final, best) holds the adapter in peft's format in this subdirectory,
beside the merged checkpoint."""
FAIL_ENV = "ASYNCRL_TEST_FAIL_CHECKPOINT_STEP"
"""Test-only: writing the checkpoint of this step fails with ENOSPC after the model files (as a
full disk would), so a test can check the error and the clean-up without filling a disk."""


# --- writing (in the trainer's process) ----------------------------------------------------------


def write_checkpoint(
    run_dir: str,
    step: int,
    keep: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    trainer_steps: int,
    run_state: bytes,
    extra_files: Sequence[str] = (),
) -> str:
    """Write the checkpoint of ``step`` whole (`staged_dir`, flushed to disk; the same step written
    again, by a resumed run, is replaced whole) and prune to the newest ``keep``; returns its path.
    A failed write leaves no half-written checkpoint behind and raises `CheckpointWriteError`."""
    import torch

    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    what = f"the checkpoint of step {step}"
    with write_errors(what, root):
        os.makedirs(root, exist_ok=True)
        remove_debris(root)  # the trainer is the one writer of checkpoints/
        with staged_dir(final, fsync=True) as tmp, write_errors(what, root):
            model.save_pretrained(os.path.join(tmp, MODEL_DIR), safe_serialization=True)
            tokenizer.save_pretrained(os.path.join(tmp, MODEL_DIR))
            for extra in extra_files:
                shutil.copy(extra, os.path.join(tmp, MODEL_DIR))
            _test_stall(step)
            _test_fail(step, os.path.join(tmp, TRAINER_TENSORS))
            tensors = {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                tensors["cuda_rng"] = torch.cuda.get_rng_state()
            torch.save(tensors, os.path.join(tmp, TRAINER_TENSORS))
            write_bytes(
                os.path.join(tmp, TRAINER_JSON),
                json.dumps({"steps": trainer_steps, "python_rng": _python_rng_state()}).encode(),
            )
            write_bytes(os.path.join(tmp, RUN_STATE), run_state)
            write_manifest(tmp)  # last: it vouches for everything above as written
    prune(run_dir, keep)
    return final


def write_policy(
    final: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    whole: dict[str, torch.Tensor] | None,
    lora: bool,
    markers: list[str],
    files: dict[str, str],
) -> str:
    """Write the policy as a Hugging Face checkpoint directory at ``final``, whole (`staged_dir`:
    a kill at any point leaves a whole policy, the old or the new), with the ``markers`` files
    copied and ``files`` (name -> text) written inside it; returns ``final``. ``whole``: the state
    dict gathered from a rank group's shards (None: ``model`` is whole in this process). ``lora``:
    a merged checkpoint for transformers and vLLM, and the adapter in `ADAPTER_DIR`. A failed
    write leaves nothing behind and raises a one-line `CheckpointWriteError`."""
    with write_errors("the policy", final):
        with staged_dir(final) as tmp, write_errors("the policy", final):  # worded before the clean-up
            if lora:
                from asyncrl.rl.trainer.lora import save_merged

                save_merged(model, tmp, whole)
                model.save_pretrained(
                    os.path.join(tmp, ADAPTER_DIR),
                    safe_serialization=True,
                    **({} if whole is None else {"state_dict": whole}),
                )
            elif whole is not None:  # gathered from the shards (trainer/fsdp.py)
                from asyncrl.rl.trainer.fsdp import save_pretrained

                save_pretrained(model, tmp, whole)
            else:
                model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            for marker in markers:
                shutil.copy(marker, tmp)
            for name, text in files.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
    return final


def write_failure(what: str, where: str, exc: BaseException) -> CheckpointWriteError:
    """The one-line error for a failed write of ``what`` into ``where`` (`write_reason`: the
    system's reason, and the disk when it is full)."""
    return CheckpointWriteError(f"cannot write {what} to {where}: {write_reason(exc, where)}")


@contextlib.contextmanager
def write_errors(what: str, where: str) -> Iterator[None]:
    """Any error of the block as `write_failure`'s one line (a `CheckpointWriteError` passes as
    it is). Put one inside a `staged_dir` too, as the innermost: the error is then worded while
    the partial write still holds its space; once `staged_dir` removes it, a full disk has room
    again and would not be named (the message was torch.save's ``unexpected pos ...``)."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except Exception as exc:
        raise write_failure(what, where, exc) from exc


def prune(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (each renamed aside first: `remove_dir`)."""
    if keep < 1:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        remove_dir(old.path)


def load_trainer_state(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> int:
    """Restore the optimiser and the RNGs saved with ``checkpoint``; returns the trainer's steps."""
    import torch

    tensors = torch.load(os.path.join(checkpoint.path, TRAINER_TENSORS), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(tensors["optimizer"])
    return restore_rngs_and_steps(checkpoint, tensors)


def restore_rngs_and_steps(checkpoint: Checkpoint, rng: dict) -> int:
    """Set torch's (and CUDA's, where saved and present) RNG from ``rng`` and Python's from the
    checkpoint's trainer JSON; returns the trainer's steps saved there."""
    import torch

    torch.set_rng_state(rng["torch_rng"])
    if "cuda_rng" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda_rng"])
    with open(os.path.join(checkpoint.path, TRAINER_JSON)) as f:
        saved = json.load(f)
    version, internal, gauss = saved["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return int(saved["steps"])


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _test_stall(step: int) -> None:
    if os.environ.get(STALL_ENV) == str(step):
        time.sleep(60.0)  # test-only (see STALL_ENV): a test SIGKILLs the trainer meanwhile


def _test_fail(step: int, path: str) -> None:
    if os.environ.get(FAIL_ENV) == str(step):  # test-only (see FAIL_ENV)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


# --- a rank group's checkpoint (DCP; every rank calls these together) ---------------------------

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
        raise CheckpointFormatError(
            f"checkpoint {os.path.basename(path)} was written by a {world_size}-rank trainer: "
            f"resume it with --trainer.world_size {world_size}"
        )


def _state(model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:  # DCP's format
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def write_sharded_checkpoint(
    rank: int,
    world_size: int,
    run_dir: str,
    step: int,
    keep: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    trainer_steps: int,
    run_state: bytes,
) -> str:
    """Every rank calls this together (inside the rank group's guard); returns the path on rank 0,
    "" on the others. A failed write raises `CheckpointWriteError` and leaves no ``step-N``."""
    import torch
    import torch.distributed as dist
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
            write_bytes(
                os.path.join(tmp, TRAINER_JSON),
                json.dumps(
                    {"steps": trainer_steps, "python_rng": [version, list(internal), gauss], "world_size": world_size}
                ).encode(),
            )
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


def load_sharded_checkpoint(
    rank: int, checkpoint: Checkpoint, model: PreTrainedModel, optimizer: torch.optim.Optimizer
) -> int:
    """Every rank calls this together: the model's and the optimiser's shards (resharded to this
    world size by DCP), this rank's RNG states and the Python RNG. Returns the trainer's steps."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not is_sharded_checkpoint(checkpoint.path):
        raise CheckpointFormatError(
            f"checkpoint {checkpoint.name} was written by a single-process trainer: "
            "resume it with --trainer.world_size 1"
        )
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(checkpoint.path, DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_path = os.path.join(checkpoint.path, RNG_DIR, f"rank{rank}.pt")
    if not os.path.exists(rng_path):  # written at a smaller world size: this rank starts from rank 0's
        rng_path = os.path.join(checkpoint.path, RNG_DIR, "rank0.pt")
    return restore_rngs_and_steps(checkpoint, torch.load(rng_path, map_location="cpu", weights_only=True))
