"""Files that readers never see half-written: write under a temporary name, then rename.

A rename within one directory is atomic on POSIX filesystems, so a reader (``asyncrl status``,
a resume, a second process building the same cache entry) sees the old file, none, or the whole
new one. On failure the temporary file is removed and the error raised: a full disk leaves no
debris behind. `disk_space` says which filesystem holds a path and how full it is, so an error can
name a full disk even where the writer's own error does not (torch.save's short write).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile


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
