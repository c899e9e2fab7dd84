"""Run a command while N cores are kept busy, to see how it behaves on a loaded machine.

    python benchmarks/cpu_hog.py --cores 1 -- python -m pytest -q tests/test_fault_tolerance.py
    python benchmarks/cpu_hog.py --cores 1 --repeat 10 -- python -m pytest -q -p no:cacheprovider tests/...

Each hog is a separate process spinning in a busy loop. They start before the first run and are
stopped when this script ends, however it ends: the command finished, it failed, Ctrl-C,
SIGTERM. The hogs also watch our pid and exit by themselves if we are SIGKILLed, so none is ever
left behind. The command runs in its own process group; on Ctrl-C or SIGTERM that whole group is
terminated too, and if we are SIGKILLed the kernel kills the command (PR_SET_PDEATHSIG). With
``--repeat K`` the command runs K times in a row and a table of
run / exit code / seconds / pytest's summary line is printed; the exit code is 0 only if every run
passed. Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import time

# The hog: spin, but look up once in a while whether the parent is still there (a SIGKILLed
# parent cannot stop us, and an orphaned busy loop would skew every later measurement).
_HOG = """
import os, sys, time
parent = int(sys.argv[1])
while True:
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass
    if os.getppid() != parent:
        sys.exit(0)
"""

_SUMMARY = re.compile(r"=+ (.*(?:passed|failed|error|no tests ran|skipped|deselected).*) in [\d.]+s.*=+")
_SHORT = re.compile(r"^(\d+ (?:passed|failed|errors?|skipped|deselected)(?:, \d+ \w+)*) in [\d.]+s", re.M)


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: end like Ctrl-C does."""


def _raise_stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL it when we die, even by SIGKILL (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the stop() calls below are all there is
    if os.getppid() != parent:  # we died before the prctl took effect
        os._exit(1)


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL) for _ in range(n)
    ]


def stop(procs: list[subprocess.Popen], group: bool = False, grace_s: float = 5.0) -> None:
    """SIGTERM (to the process group with ``group``), wait up to ``grace_s``, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig) if group else p.send_signal(sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return


def summary_line(output: str) -> str:
    """pytest's final line (``3 passed, 1 failed in 12.3s``) if there is one, else the last line."""
    for pattern in (_SUMMARY, _SHORT):
        found = pattern.findall(output)
        if found:
            return found[-1].strip()
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip()[:100] if lines else ""


def run_once(command: list[str], log_path: str | None) -> tuple[int, float, str]:
    """Run ``command`` in its own process group, echoing its output as it comes; returns
    (exit code, seconds, summary line). Ctrl-C or SIGTERM stops the whole group."""
    start = time.monotonic()
    parent = os.getpid()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent),
    )
    chunks: list[str] = []
    log = open(log_path, "w") if log_path else None
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            chunks.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
            if log is not None:
                log.write(line)
        proc.wait()
    except BaseException:
        stop([proc], group=True)
        raise
    finally:
        proc.stdout.close()
        if log is not None:
            log.close()
    stop([proc], group=True, grace_s=1.0)  # whatever the command left behind in its group
    return proc.returncode, time.monotonic() - start, summary_line("".join(chunks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s [--cores N] [--repeat K] [--log-dir DIR] -- COMMAND ..."
    )
    parser.add_argument("--cores", type=int, default=1, help="busy loops to run (default 1)")
    parser.add_argument("--repeat", type=int, default=1, help="run the command this many times (default 1)")
    parser.add_argument("--log-dir", default="", help="write each run's output to DIR/run-K.log")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.cores < 0 or args.repeat < 1:
        parser.error("--cores must be >= 0 and --repeat >= 1")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a shell started us ignoring it
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    hogs = start_hogs(args.cores)
    print(
        f"cpu_hog: {args.cores} busy loop(s) (pids {[h.pid for h in hogs]}) on {os.cpu_count()} cores; "
        f"running {' '.join(command)!r} {args.repeat} time(s)",
        flush=True,
    )
    rows: list[tuple[int, int, float, str]] = []
    interrupted = ""
    try:
        for k in range(1, args.repeat + 1):
            log = os.path.join(args.log_dir, f"run-{k}.log") if args.log_dir else None
            code, seconds, line = run_once(command, log)
            rows.append((k, code, seconds, line))
            print(f"cpu_hog: run {k}/{args.repeat}: exit {code} in {seconds:.1f} s: {line}", flush=True)
    except (KeyboardInterrupt, _Stop) as exc:
        interrupted = type(exc).__name__ if isinstance(exc, KeyboardInterrupt) else str(exc)
    finally:
        stop(hogs)
    print()
    print(f"{'run':>4}  {'exit':>4}  {'seconds':>8}  result")
    for k, code, seconds, line in rows:
        print(f"{k:>4}  {code:>4}  {seconds:>8.1f}  {line}")
    passed = sum(code == 0 for _, code, _, _ in rows)
    print(f"{passed}/{len(rows)} runs passed" + (f" (interrupted by {interrupted})" if interrupted else ""), flush=True)
    if interrupted:
        return 130
    return 0 if passed == len(rows) == args.repeat else 1


if __name__ == "__main__":
    sys.exit(main())
