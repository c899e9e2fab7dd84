"""Resumable checkpoints of a GRPO run: what is saved, how it is written, and how it is found.

A checkpoint is one directory ``RUN_DIR/checkpoints/step-NNNNNNNN/``:

    model/            the policy as a Hugging Face checkpoint (transformers loads it as is)
    trainer.pt        optimiser state_dict and torch RNG states: tensors and plain Python values
                      only, so ``torch.load(..., weights_only=True)`` reads it (no pickled objects)
    trainer.json      the trainer's step count and Python RNG state
    run_state.json    the driver's `RunState` (``driver/run_state.py``): step, weight version,
                      counters, each sampler's data walk position and sampling RNG, held-out
                      rates so far
    MANIFEST.json     every other file's size and SHA-256, written last

Atomicity (``runtime/files.py``'s `staged_dir`): everything is written into a temporary sibling directory, flushed to
disk, and then renamed into place in one ``os.replace``; a directory named ``step-*`` is therefore
always whole, and a process killed mid-write leaves only a ``.tmp-*`` directory that the next
write or resume removes. Old checkpoints beyond ``keep`` are first renamed aside, then deleted
(`remove_dir`), so a kill during pruning never leaves a half-deleted ``step-*`` directory either.
A write that fails (a full disk) removes its temporary directory and raises a one-line
`CheckpointWriteError`.

Integrity: a whole directory can still be damaged later (a disk error, a copy cut short, a
hand edit). ``--resume`` checks the newest checkpoint against its manifest before trusting it
(`verify_checkpoint`) and falls back to the newest one that passes; a checkpoint written before
manifests existed is accepted unverified.

The writer (``trainer/checkpoint.py``) runs in the trainer's process (it holds the model and the
optimiser); the run directory must be reachable from there under the same path (one host, or a
shared filesystem), as for the final policy.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import msgspec

from asyncrl.errors import AsyncrlError, first_line
from asyncrl.rl.config.parse import ConfigError
from asyncrl.runtime.files import disk_space, write_bytes

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
RUN_STATE = "run_state.json"
TRAINER_TENSORS = "trainer.pt"
TRAINER_JSON = "trainer.json"
MODEL_DIR = "model"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that does not fit the run it is resumed into. A `ConfigError`:
    like a refused setting, it is found before anything is trained or written (exit status 2)."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (or cannot be read); ``reason`` says which
    file and how, e.g. ``trainer.pt: size 0, expected 1234``."""

    def __init__(self, checkpoint: Checkpoint, reason: str):
        super().__init__(f"checkpoint {checkpoint.name} is damaged ({reason})")
        self.checkpoint, self.reason = checkpoint, reason


class CheckpointWriteError(AsyncrlError):
    """A checkpoint or a policy could not be written (a full disk, a read-only filesystem); the
    message is one line naming what, where and the system's reason. Nothing half-written stays."""


_NO_SPACE, _QUOTA = os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)
_REASONS_IN_WORDS = (
    ("No space left", _NO_SPACE),
    ("StorageFull", _NO_SPACE),
    ("Disk quota", _QUOTA),
    ("Read-only file", os.strerror(errno.EROFS)),
)
"""A full disk does not always arrive as an OSError: safetensors and torch.save wrap it in errors
of their own, some naming it in words of their own (``IoError(StorageFull)``)."""


def write_reason(exc: BaseException, where: str) -> str:
    """Why a write under the run directory (into ``where``) failed, for a one-line error: the
    system's reason; on a (nearly) full filesystem, also which one, what is left, and what to do,
    ``No space left on device (tmpfs at /mnt/run has 4 KiB free of 30 MiB: free space there before
    resuming)``. The disk is looked at because the writer's error may not say: torch.save's short
    write reads ``unexpected pos 2586048 vs 2585936``. Word it while the partial write still holds
    its space (`write_failure`'s callers do): once removed, the disk no longer looks full."""
    stated = exc.strerror if isinstance(exc, OSError) and exc.strerror else None
    if stated is None:
        stated = next((reason for needle, reason in _REASONS_IN_WORDS if needle in str(exc)), None)
    space = disk_space(where)
    if space is not None and space.nearly_full and stated in (None, _NO_SPACE):  # a quota is not in disk_usage
        return f"{_NO_SPACE} ({space}: free space there before resuming)"
    return stated or f"{type(exc).__name__}: {first_line(exc)}"


class SamplerDataState(msgspec.Struct, frozen=True):
    """Where one sampler's data stands: ``drawn`` prompts taken from its walk over the train split
    (seeded by ``seed``), and its sampling RNG (``generator``: a torch generator state; empty
    means keep the sampler's own). ``generator_seed`` >= 0 reseeds the RNG instead: a restarted
    sampler gets a fresh stream, not a replay of its previous incarnation's."""

    seed: int
    drawn: int
    generator: bytes = b""
    generator_seed: int = -1


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str

    @property
    def model_dir(self) -> str:
        return os.path.join(self.path, MODEL_DIR)

    @property
    def name(self) -> str:
        """``step-40``: how messages name it (the directory is ``step-00000040``)."""
        return f"{PREFIX}{self.step}"


# --- finding ------------------------------------------------------------------------------------


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def list_checkpoints(run_dir: str) -> list[Checkpoint]:
    """Complete checkpoints of ``run_dir``, oldest first (a ``step-*`` name is only ever given to a
    whole directory, by the rename that ends a write)."""
    root = checkpoints_dir(run_dir)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit():
            found.append(Checkpoint(int(name[len(PREFIX) :]), os.path.join(root, name)))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str) -> Checkpoint:
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(
            f"no checkpoint to resume from in {checkpoints_dir(run_dir)} "
            "(a run writes them every --run.checkpoint_every steps)"
        )
    return found[-1]


def verify_checkpoint(checkpoint: Checkpoint) -> bool:
    """Check ``checkpoint`` before a resume trusts it: every file of its manifest there, with the
    recorded size (all first: cheap) and SHA-256. Returns True if it was verified, False if it has
    no manifest (written by an older version: only the files' presence is checked); raises
    `DamagedCheckpointError` naming the first problem. Reads every byte: seconds for a model of a
    few GB, once per resume. (Whether the run state decodes is the driver's to check:
    ``driver/run_state.py``.)"""
    path = checkpoint.path
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        for name in (RUN_STATE, TRAINER_TENSORS, TRAINER_JSON, MODEL_DIR):
            if not os.path.exists(os.path.join(path, name)):
                raise DamagedCheckpointError(checkpoint, f"{name}: missing")
        return False
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
        files = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(checkpoint, f"{MANIFEST}: unreadable ({first_line(exc)})") from None
    for name in (RUN_STATE, TRAINER_TENSORS, TRAINER_JSON):
        if name not in files:
            raise DamagedCheckpointError(checkpoint, f"{MANIFEST}: does not list {name}")
    for name, (size, _) in sorted(files.items()):
        try:
            actual = os.path.getsize(os.path.join(path, name))
        except OSError:
            raise DamagedCheckpointError(checkpoint, f"{name}: missing") from None
        if actual != size:
            raise DamagedCheckpointError(checkpoint, f"{name}: size {actual}, expected {size}")
    digests = _sha256_all([os.path.join(path, name) for name in sorted(files)])
    for name, (_, digest) in sorted(files.items()):
        got = digests[os.path.join(path, name)]
        if isinstance(got, OSError):
            raise DamagedCheckpointError(checkpoint, f"{name}: unreadable ({got.strerror or got})")
        if got != digest:
            raise DamagedCheckpointError(
                checkpoint, f"{name}: contents differ from the manifest (SHA-256 {got[:12]}, expected {digest[:12]})"
            )
    return True


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):  # chunks: a model file may not fit in memory twice
            h.update(chunk)
    return h.hexdigest()


def _sha256_all(paths: list[str]) -> dict[str, str | OSError]:
    """Each file's SHA-256 (or the OSError reading it), several files at once: hashlib releases
    the GIL on large updates, and a big checkpoint (model shards, the optimiser state) would
    otherwise take one core's hashing speed per byte. Bounded: every file is read once."""

    def one(path: str) -> str | OSError:
        try:
            return file_sha256(path)
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths), os.cpu_count() or 1))) as pool:
        return dict(zip(paths, pool.map(one, paths)))


def write_manifest(folder: str) -> None:
    """``folder``/MANIFEST.json: the size and SHA-256 of every file under ``folder`` (paths
    relative to it, with ``/``), so a reader can tell a whole checkpoint from a damaged one."""
    paths = {}
    for parent, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(parent, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                paths[rel] = full
    digests = _sha256_all(list(paths.values()))
    files: dict[str, dict[str, int | str]] = {}
    for rel, full in paths.items():
        digest = digests[full]
        if isinstance(digest, OSError):
            raise digest
        files[rel] = {"size": os.path.getsize(full), "sha256": digest}
    write_bytes(
        os.path.join(folder, MANIFEST), json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1).encode()
    )
