"""Resumable checkpoints of a GRPO run: what is saved, how it is written, and how it is found.

A checkpoint is one directory ``RUN_DIR/checkpoints/step-NNNNNNNN/``:

    model/            the policy as a Hugging Face checkpoint (transformers loads it as is)
    trainer.pt        optimiser state_dict and torch RNG states: tensors and plain Python values
                      only, so ``torch.load(..., weights_only=True)`` reads it (no pickled objects)
    trainer.json      the trainer's step count and Python RNG state
    run_state.json    the driver's `RunState`: step, weight version, counters, each sampler's
                      data walk position and sampling RNG, held-out rates so far
    MANIFEST.json     every other file's size and SHA-256, written last

Atomicity: everything is written into a temporary sibling directory, flushed to disk, and then
renamed into place in one ``os.replace``; a directory named ``step-*`` is therefore always whole,
and a process killed mid-write leaves only a ``.tmp-*`` directory that the next write or resume
removes. Old checkpoints beyond ``keep`` are first renamed aside, then deleted, so a kill during
pruning never leaves a half-deleted ``step-*`` directory either. A write that fails (a full
disk) removes its temporary directory and raises a one-line `CheckpointWriteError`.

Integrity: a whole directory can still be damaged later (a disk error, a copy cut short, a
hand edit). ``--resume`` checks the newest checkpoint against its manifest before trusting it
(`verify_checkpoint`) and falls back to the newest one that passes; a checkpoint written before
manifests existed is accepted unverified.

The writer runs in the trainer's process (it holds the model and the optimiser); the run
directory must be reachable from there under the same path (one host, or a shared filesystem),
as for the final policy.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.rl.config import ConfigError

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
RUN_STATE = "run_state.json"
TRAINER_TENSORS = "trainer.pt"
TRAINER_JSON = "trainer.json"
MODEL_DIR = "model"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 8 << 20

STALL_ENV = "ASYNCRL_TEST_STALL_CHECKPOINT_STEP"
"""Test-only: the trainer stalls (60 s) while writing the checkpoint of this step, after the model
files and before the rest, so a test can kill it mid-write. Never set it in a real run."""
FAIL_ENV = "ASYNCRL_TEST_FAIL_CHECKPOINT_STEP"
"""Test-only: writing the checkpoint of this step fails with ENOSPC after the model files (as a
full disk would), so a test can check the error and the clean-up without filling a disk."""


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
        raise DamagedCheckpointError(checkpoint, f"{MANIFEST}: unreadable ({_first_line(exc)})") from None
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
        raise DamagedCheckpointError(checkpoint, f"{RUN_STATE}: not a valid run state ({_first_line(exc)})") from None
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


# --- writing (in the trainer's process) ----------------------------------------------------------


def write_checkpoint(run_dir: str, step: int, keep: int, model: Any, tokenizer: Any, optimizer: Any,
                     trainer_steps: int, run_state: bytes, extra_files: list[str] = ()) -> str:
    """Write the checkpoint of ``step`` atomically and prune to the newest ``keep``; returns its path."""
    import torch

    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    tmp = os.path.join(root, f".tmp-{PREFIX}{step:08d}-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        _remove_debris(root)
        os.makedirs(tmp)
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
        _write_bytes(os.path.join(tmp, TRAINER_JSON),
                     json.dumps({"steps": trainer_steps, "python_rng": _python_rng_state()}).encode())
        _write_bytes(os.path.join(tmp, RUN_STATE), run_state)
        write_manifest(tmp)  # last: it vouches for everything above as written
        _fsync_tree(tmp)
        if os.path.exists(final):  # the same step written again (a resumed run): replace it whole
            _discard(root, final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise write_failure(f"the checkpoint of step {step}", root, exc) from exc
    prune(run_dir, keep)
    return final


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
    _write_bytes(os.path.join(folder, MANIFEST),
                 json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1).encode())


def write_failure(what: str, where: str, exc: BaseException) -> CheckpointWriteError:
    """The one-line error for a failed write of ``what`` into ``where``. A full disk does not
    always arrive as an OSError: safetensors and torch.save wrap it in their own errors (torch's
    says only "file write failed"), so the disk is looked at when the error does not say."""
    return CheckpointWriteError(f"cannot write {what} to {where}: {_write_reason(exc, where)}")


def _write_reason(exc: BaseException, where: str) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    for needle, reason in (("No space left", os.strerror(errno.ENOSPC)), ("StorageFull", os.strerror(errno.ENOSPC)),
                           ("Disk quota", os.strerror(errno.EDQUOT)), ("Read-only file", os.strerror(errno.EROFS))):
        if needle in text:
            return reason
    try:
        if shutil.disk_usage(where if os.path.exists(where) else os.path.dirname(where)).free < (1 << 20):
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def prune(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (renamed aside first: see the module doc)."""
    if keep < 1:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        _discard(checkpoints_dir(run_dir), old.path)


def load_trainer_state(checkpoint: Checkpoint, optimizer: Any) -> int:
    """Restore the optimiser and the RNGs saved with ``checkpoint``; returns the trainer's steps."""
    import torch

    tensors = torch.load(os.path.join(checkpoint.path, TRAINER_TENSORS), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(tensors["optimizer"])
    torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda_rng"])
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


def _remove_debris(root: str) -> None:
    """Temporary directories of writes or prunes that a kill interrupted."""
    for name in os.listdir(root):
        if name.startswith((".tmp-", ".old-")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _discard(root: str, path: str) -> None:
    aside = os.path.join(root, f".old-{os.path.basename(path)}-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the driver's side --------------------------------------------------------------------------


def write_json_atomic(path: str, value: Any) -> None:
    """``value`` as JSON at ``path``, replacing the old file in one rename (a reader never sees
    half). On failure (a full disk) the temporary file is removed and the error raised."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def truncate_metrics(path: str, step: int) -> int:
    """Keep the records of steps <= ``step`` in metrics.jsonl (atomically); returns how many."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by the crash: nothing after it was written whole
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(kept)


def config_from_dict(default: Any, values: Mapping[str, Any], where: str = "config") -> Any:
    """The config tree ``default`` with the values of ``values`` (as `config_to_dict` wrote them
    into config.json). A key the tree does not have is a `CheckpointError` naming it."""
    changes = {}
    fields = {f.name: f for f in dataclasses.fields(default)}
    for key, value in values.items():
        if key not in fields:
            raise CheckpointError(f"{where}: unknown key {key!r} (the run was written by another version?)")
        current = getattr(default, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = config_from_dict(current, value, f"{where}.{key}")
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


# --- sampler state and weight digests (used in the actors) ---------------------------------------


class CountedWalk:
    """A sampler's walk over the train split that counts the prompts it handed out, so that a
    resumed run continues the walk where the checkpoint left it (``drawn`` skipped at start)."""

    def __init__(self, walk: Iterator[int], drawn: int = 0):
        self._walk = walk
        for _ in range(drawn):
            next(self._walk)
        self.drawn = drawn

    def __iter__(self) -> "CountedWalk":
        return self

    def __next__(self) -> int:
        index = next(self._walk)
        self.drawn += 1
        return index


def tensor_digest(tensors: Mapping[str, Any]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: two holders of
    the same weights get the same digest whatever device or process they live in."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
