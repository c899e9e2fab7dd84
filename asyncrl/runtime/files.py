"""Files and directories that readers never see half-written: write under a temporary name, then
rename (`write_atomic` for a file, `staged_dir` for a whole directory, `remove_dir` to delete one).

A rename within one directory is atomic on POSIX filesystems, so a reader (``asyncrl status``,
a resume, a second process building the same cache entry) sees the old file, none, or the whole
new one. On failure the temporary file is removed and the error raised: a full disk leaves no
debris behind. `disk_space` says which filesystem holds a path and how full it is, so an error can
name a full disk even where the writer's own error does not (torch.save's short write).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any


def write_atomic(path: str, data: bytes | str, *, fsync: bool = False) -> None:
    """``data`` at ``path``, replacing what was there in one rename. ``fsync``: flush the file to
    disk before the rename (what must survive a power loss, not only a killed process)."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
            fsync_tree(tmp)
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


def fsync_tree(path: str) -> None:
    """Flush every file under ``path``, and each directory's entries, to disk."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


@dataclasses.dataclass(frozen=True)
class DiskSpace:
    """The filesystem that holds a path: its device (``tmpfs``, ``/dev/nvme0n1p2``; "" if unknown),
    where it is mounted, and the bytes an unprivileged writer has left of its size."""

    device: str
    mount: str
    free: int
    total: int

    @property
    def nearly_full(self) -> bool:
        """Too little left for a run's next write: under 0.5% of the filesystem, at least 1 MiB,
        at most 1 GiB (a write that failed with more than that free failed for another reason)."""
        return self.free < min(max(1 << 20, self.total // 200), 1 << 30)

    def __str__(self) -> str:
        where = f"{self.device} at {self.mount}" if self.device else f"the filesystem at {self.mount}"
        return f"{where} has {size_text(self.free)} free of {size_text(self.total)}"


def disk_space(path: str) -> DiskSpace | None:
    """The `DiskSpace` of ``path``'s filesystem (of its nearest existing parent: a failed write
    may have removed what it made); None where the system does not say."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    try:
        usage = shutil.disk_usage(path)
        mount = path
        while not os.path.ismount(mount):
            mount = os.path.dirname(mount)
    except OSError:
        return None
    return DiskSpace(_device_of(mount), mount, usage.free, usage.total)


def size_text(n: int) -> str:
    """``n`` bytes for a reader: ``0 B``, ``112 KiB``, ``30 MiB``, ``1.5 GiB``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.3g} {unit}" if unit != "B" else f"{n} B"


def _device_of(mount: str) -> str:
    """What /proc/self/mounts names the filesystem mounted last at ``mount``; "" if unknown."""
    device = ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2 and _unescape(fields[1]) == mount:
                    device = _unescape(fields[0])
    except OSError:
        pass
    return device


def _unescape(field: str) -> str:
    """/proc/self/mounts writes a space, a tab, a newline and a backslash in a path as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
