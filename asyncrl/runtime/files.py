"""Files that readers never see half-written: write under a temporary name, then rename.

A rename within one directory is atomic on POSIX filesystems, so a reader (``asyncrl status``,
a resume, a second process building the same cache entry) sees the old file, none, or the whole
new one. On failure the temporary file is removed and the error raised: a full disk leaves no
debris behind.
"""

from __future__ import annotations

import os
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
