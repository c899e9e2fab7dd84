"""Resumable checkpoints of a GRPO run: what is saved, how it is written, and how it is found.

A checkpoint is one directory ``RUN_DIR/checkpoints/step-NNNNNNNN/``:

    model/            the policy as a Hugging Face checkpoint (transformers loads it as is)
    trainer.pt        optimiser state_dict and torch RNG states: tensors and plain Python values
                      only, so ``torch.load(..., weights_only=True)`` reads it (no pickled objects)
    trainer.json      the trainer's step count and Python RNG state
    run_state.json    the driver's `RunState`: step, weight version, counters, each sampler's
                      data walk position and sampling RNG, held-out rates so far
    MANIFEST.json     every other file's size and SHA-256, written last

Atomicity (`staged_dir`): everything is written into a temporary sibling directory, flushed to
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
shared filesystem), as for the final policy. This module also reads a run's ``config.json`` back
into its config tree (`load_run_config`), for a resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from asyncrl.errors import AsyncrlError, first_line
from asyncrl.rl.config.parse import ConfigError, field_path, is_flat
from asyncrl.runtime.files import disk_space, write_atomic

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

    def __init__(self, checkpoint: "Checkpoint", reason: str):
        super().__init__(f"checkpoint {checkpoint.name} is damaged ({reason})")
        self.checkpoint, self.reason = checkpoint, reason


class CheckpointWriteError(AsyncrlError):
    """A checkpoint or a policy could not be written (a full disk, a read-only filesystem); the
    message is one line naming what, where and the system's reason. Nothing half-written stays."""


_NO_SPACE, _QUOTA = os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)
_REASONS_IN_WORDS = (("No space left", _NO_SPACE), ("StorageFull", _NO_SPACE), ("Disk quota", _QUOTA),
                     ("Read-only file", os.strerror(errno.EROFS)))
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


class RunState(msgspec.Struct):
    """The driver's side of a checkpoint (``run_state.json``)."""

    step: int
    version: int
    samples: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    uniform_skipped: int = 0
    """Groups left out for having one reward for every completion (``run.skip_uniform_groups``)."""
    train_s: float = 0.0
    """Wall seconds of training up to this checkpoint, over every resumed segment."""
    heldout_before: dict[str, float] = {}
    heldout_last: dict[str, float] = {}
    samplers: list[SamplerDataState] = []
    faults: dict[str, int] = {}
    """Fault counters so far (sampler losses, rejoins, ...), carried into the resumed run."""
    segment: int = 0
    """How many resumes led to this checkpoint (0: written by the run's first process tree). The
    group ids of a segment carry it, so that a resumed run (whose samplers number their groups
    from 1 again) never reuses an id of the steps it continues from."""


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

    def run_state(self) -> RunState:
        with open(os.path.join(self.path, RUN_STATE), "rb") as f:
            try:
                return msgspec.json.decode(f.read(), type=RunState)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise CheckpointError(f"{self.path}/{RUN_STATE} is not a valid run state: {exc}") from None


# --- finding ------------------------------------------------------------------------------------


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def list_checkpoints(run_dir: str) -> list[Checkpoint]:
    """Complete checkpoints of ``run_dir``, oldest first (a ``step-*`` name is only ever given to a
    whole directory, by the rename that ends a write)."""
    root = checkpoints_dir(run_dir)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            found.append(Checkpoint(int(name[len(PREFIX):]), os.path.join(root, name)))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str) -> Checkpoint:
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint to resume from in {checkpoints_dir(run_dir)} "
                              "(a run writes them every --run.checkpoint_every steps)")
    return found[-1]


def verify_checkpoint(checkpoint: Checkpoint) -> bool:
    """Check ``checkpoint`` before a resume trusts it: every file of its manifest there, with the
    recorded size (all first: cheap) and SHA-256, and a run state that decodes. Returns True if
    it was verified, False if it has no manifest (written by an older version: only the files'
    presence and the run state are checked); raises `DamagedCheckpointError` naming the first
    problem. Reads every byte: seconds for a model of a few GB, once per resume."""
    path = checkpoint.path
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        for name in (RUN_STATE, TRAINER_TENSORS, TRAINER_JSON, MODEL_DIR):
            if not os.path.exists(os.path.join(path, name)):
                raise DamagedCheckpointError(checkpoint, f"{name}: missing")
        _check_run_state(checkpoint)
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
        actual = digests[os.path.join(path, name)]
        if isinstance(actual, OSError):
            raise DamagedCheckpointError(checkpoint, f"{name}: unreadable ({actual.strerror or actual})")
        if actual != digest:
            raise DamagedCheckpointError(checkpoint, f"{name}: contents differ from the manifest (SHA-256 "
                                                     f"{actual[:12]}, expected {digest[:12]})")
    _check_run_state(checkpoint)
    return True


def _check_run_state(checkpoint: Checkpoint) -> None:
    try:
        with open(os.path.join(checkpoint.path, RUN_STATE), "rb") as f:
            msgspec.json.decode(f.read(), type=RunState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DamagedCheckpointError(checkpoint, f"{RUN_STATE}: not a valid run state ({first_line(exc)})") from None
    except OSError as exc:
        raise DamagedCheckpointError(checkpoint, f"{RUN_STATE}: unreadable ({exc.strerror or exc})") from None


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
    files = {}
    for rel, full in paths.items():
        if isinstance(digests[full], OSError):
            raise digests[full]
        files[rel] = {"size": os.path.getsize(full), "sha256": digests[full]}
    write_bytes(os.path.join(folder, MANIFEST),
                 json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1).encode())


def write_bytes(path: str, data: bytes) -> None:
    """A file inside a `staged_dir`: the directory's rename makes it appear whole, not its own."""
    with open(path, "wb") as f:
        f.write(data)


def write_json_atomic(path: str, value: Any) -> None:
    """``value`` as JSON at ``path``, replacing the old file in one rename (a reader never sees
    half). On failure (a full disk) the temporary file is removed and the error raised."""
    text = io.StringIO()
    json.dump(value, text, indent=1)
    write_atomic(path, text.getvalue())


# --- writing a directory whole ------------------------------------------------------------------


TMP_PREFIX, ASIDE_PREFIX = ".tmp-", ".old-"
"""Names of `staged_dir`'s and `remove_dir`'s transient siblings: a reader never takes them for a
directory it looks for, and a writer that owns the parent removes them (a kill left them)."""


def replace_dir(tmp: str, final: str, aside: str) -> None:
    """Rename the whole directory ``tmp`` to ``final``. An old ``final`` is renamed to ``aside``
    first and put back if the rename fails; the caller deletes ``aside`` once it is done with it."""
    replaced = os.path.exists(final)
    if replaced:
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if replaced:
            os.replace(aside, final)
        raise


@contextlib.contextmanager
def staged_dir(final: str, *, fsync: bool = False) -> Iterator[str]:
    """A fresh, empty sibling of ``final`` (``.tmp-<name>-<pid>``) for the block to write into,
    renamed to ``final`` when the block ends. Readers see the old directory whole or the new one
    whole: an old ``final`` is renamed aside (``.old-<name>-<pid>``) before the new one takes its
    name and deleted only after, so a kill at any point leaves each whole under a name of its own.
    If the block or a rename fails, the temporary directory is removed, an old ``final`` renamed
    aside is put back, and the error propagates. ``fsync``: the new tree is flushed to disk before
    the rename and the parent after it (what must survive a power loss, not only a kill)."""
    parent, name = os.path.split(os.path.abspath(final))
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{os.getpid()}")
    aside = os.path.join(parent, f"{ASIDE_PREFIX}{name}-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # this pid's own leftover
        os.makedirs(tmp)
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        replace_dir(tmp, final, aside)
        if fsync:
            fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)  # the old final, if there was one


def remove_dir(path: str) -> None:
    """Delete the directory ``path``: renamed aside (``.old-<name>-<pid>``) first, then deleted, so
    a kill meanwhile never leaves a half-deleted directory under its name."""
    parent, name = os.path.split(os.path.abspath(path))
    aside = os.path.join(parent, f"{ASIDE_PREFIX}{name}-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_debris(folder: str) -> None:
    """The transient directories in ``folder`` of writes or removals that a kill interrupted. Only
    for a folder whose one writer is the caller (another writer's staging would go too)."""
    for name in os.listdir(folder):
        if name.startswith((TMP_PREFIX, ASIDE_PREFIX)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def fsync_path(path: str) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


# --- the run's config.json ----------------------------------------------------------------------


def config_from_dict(default: Any, values: Mapping[str, Any], where: str = "config") -> Any:
    """The config tree ``default`` with the values of ``values`` (as `config_to_dict` wrote them
    into config.json: a flat section's keys in its parent's dict). A key the tree does not have
    is a `CheckpointError` naming it."""
    grouped: dict[str, Any] = {}
    for key, value in values.items():
        path = field_path(default, key)
        if path is None:
            raise CheckpointError(f"{where}: unknown key {key!r} (the run was written by another version?)")
        node = grouped
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return _rebuilt(default, grouped, where)


def _rebuilt(default: Any, grouped: Mapping[str, Any], where: str) -> Any:
    changes = {}
    fields = {f.name: f for f in dataclasses.fields(default)}
    for key, value in grouped.items():
        current = getattr(default, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = (_rebuilt(current, value, where) if is_flat(fields[key])
                            else config_from_dict(current, value, f"{where}.{key}"))
        elif isinstance(current, tuple) and isinstance(value, list):
            changes[key] = tuple(value)
        else:
            changes[key] = value
    try:
        return dataclasses.replace(default, **changes)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def load_run_config(default: Any, run_dir: str) -> Any:
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"--resume {run_dir}: no config.json there (not a run directory?)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return config_from_dict(default, values)
