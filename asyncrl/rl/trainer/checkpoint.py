"""Writing and loading a resumable checkpoint in the trainer's process (it holds the model and the
optimiser), and the one-line error of a failed write (of a checkpoint or a policy). The directory
format, its manifest, how a directory is written whole and how checkpoints are found are in
``rl/checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from typing import Any

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
from asyncrl.runtime.files import remove_debris, remove_dir, staged_dir, write_bytes

STALL_ENV = "ASYNCRL_TEST_STALL_CHECKPOINT_STEP"
"""Test-only: the trainer stalls (60 s) while writing the checkpoint of this step, after the model
files and before the rest, so a test can kill it mid-write. Never set it in a real run."""
FAIL_ENV = "ASYNCRL_TEST_FAIL_CHECKPOINT_STEP"
"""Test-only: writing the checkpoint of this step fails with ENOSPC after the model files (as a
full disk would), so a test can check the error and the clean-up without filling a disk."""


# --- writing (in the trainer's process) ----------------------------------------------------------


def write_checkpoint(run_dir: str, step: int, keep: int, model: Any, tokenizer: Any, optimizer: Any,
                     trainer_steps: int, run_state: bytes, extra_files: list[str] = ()) -> str:
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
            write_bytes(os.path.join(tmp, TRAINER_JSON),
                        json.dumps({"steps": trainer_steps, "python_rng": _python_rng_state()}).encode())
            write_bytes(os.path.join(tmp, RUN_STATE), run_state)
            write_manifest(tmp)  # last: it vouches for everything above as written
    prune(run_dir, keep)
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


def load_trainer_state(checkpoint: Checkpoint, optimizer: Any) -> int:
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
