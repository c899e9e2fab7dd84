"""RUN_DIR/log.txt: the console of a run, kept in its directory."""

from __future__ import annotations

import builtins
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

LOG_FILE = "log.txt"


class RunLog:
    """RUN_DIR/log.txt: the console of the run. While it is entered, ``sys.stdout`` and
    ``sys.stderr`` are teed into it; that takes in the driver's lines and the progress lines, and
    the actors' output too (the supervisor pumps each actor's output into the ``sys.stdout`` and
    ``sys.stderr`` it finds when it spawns the actor). Python-level, not fd-level: nothing of the
    process's descriptors or the terminal changes (isatty, colours), and a crash of the tee cannot
    take the output with it. A line a terminal would overwrite (``\r``: the tty progress line) is
    kept as the terminal leaves it. What is printed before the run directory is known to be ours
    (a resume not yet loaded) is held back, and dropped if the run never starts. A write that
    fails (a full disk) stops the log, never the run."""

    MAX_HELD = 10000

    def __init__(self, path: str, log: Callable[[str], None]):
        self.path, self._log = path, log
        self.file: TextIO | None = None
        self.held: list[str] = []
        self.partial = {1: "", 2: ""}
        self.lock = threading.Lock()
        self.active = False
        self.saved: tuple[TextIO, TextIO] = (sys.stdout, sys.stderr)  # set again as it starts

    def log(self, line: str) -> None:
        """The driver's ``log``: the caller's function, and the file (a ``print`` reaches it
        through the tee; any other function would not)."""
        self._log(line)
        if self._log is not builtins.print:
            self.record(line)

    def record(self, line: str) -> None:
        """One line into the file only."""
        self.write(line + "\n", 0)

    def write(self, text: str, stream: int) -> None:
        with self.lock:
            if not self.active:
                return
            if stream == 0:
                lines = text.split("\n")[:-1]
            else:
                lines = (self.partial[stream] + text).split("\n")
                self.partial[stream] = lines.pop().rsplit("\r", 1)[-1]
            self._emit([line.rsplit("\r", 1)[-1] for line in lines])

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        if self.file is None:
            self.held.extend(lines)
            del self.held[: -self.MAX_HELD]
            return
        try:
            self.file.write("".join(line + "\n" for line in lines))
        except (OSError, ValueError):
            self._stop_file()

    def open(self, what: str) -> None:
        """The run directory is ours: write what was held back, and from now on as it comes."""
        with self.lock:
            try:
                self.file = file = open(self.path, "a", buffering=1)
                file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what} ---\n")
            except OSError:
                self._stop_file()
                return
            held, self.held = self.held, []
            self._emit(held)

    def _stop_file(self) -> None:
        self.active = False
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
        self.file = None

    def __enter__(self) -> RunLog:
        self.active = True
        self.saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self, 1), _Tee(sys.stderr, self, 2)
        return self

    def __exit__(self, *exc: object) -> None:
        out, err = self.saved
        if isinstance(sys.stdout, _Tee) and sys.stdout.log is self:
            sys.stdout = out
        if isinstance(sys.stderr, _Tee) and sys.stderr.log is self:
            sys.stderr = err
        with self.lock:
            tail = [p for p in self.partial.values() if p]
            self.partial = {1: "", 2: ""}
            if self.active and self.file is not None:
                self._emit(tail)
            self._stop_file()  # the tees stay with the actors' output pumps, passing it on only


class _Tee:
    """A text stream that passes everything on to ``stream`` and records it in a `RunLog`."""

    def __init__(self, stream: TextIO, log: RunLog, number: int):
        self.stream, self.log, self.number = stream, log, number

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.log.write(text, self.number)
        return n

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)
