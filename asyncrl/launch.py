"""Run a user script the way ``asyncrl launch`` promises: its ``main()`` (sync or async) under
uvloop when available, with SIGINT/SIGTERM turned into cancellation so ``async with Supervisor()``
stops every actor before we exit with ``128 + signal``. A script without a ``main`` function runs
as ``__main__``, exactly as ``python script.py`` would.

What reaches the user: a `UsageError` (a bad flag or path, e.g. a `ConfigError`) escaping the
script is its message on one line and exit status 2; an `ActionableError` (an actor not ready in
time, memory that ran out: a setting or the machine to change) its first line and exit status 1;
``sys.exit("message")`` prints the message and exits 1, as Python does; stdout closed by its
reader (``--help | head``) ends quietly with 128 + SIGPIPE, as a filter does; a traceback means a
bug. After a first SIGINT/SIGTERM the shutdown is
orderly; a second one during it kills the actors' process groups and exits at once
(`signals.force_exit`)."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import os
import runpy
import signal
import sys
import threading
import traceback
import types

from asyncrl.errors import ActionableError, UsageError, one_line
from asyncrl.runtime import signals
from asyncrl.runtime.loop import run as run_loop
from asyncrl.runtime.worker import SCRIPT_MODULE

EXIT_USAGE = 2


def _defines_main(path: str) -> bool:
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main" for node in tree.body)


def _load(path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file that can be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCRIPT_MODULE] = module  # actor classes defined in the script resolve to this file
    spec.loader.exec_module(module)
    return module


async def _run_main(main) -> object:
    task = asyncio.ensure_future(main())
    try:
        with signals.cancel_on_signals(task):
            return await task
    finally:
        # main() is over but the loop still closes (remaining tasks, executor threads: a warm start
        # in asyncio.to_thread runs to its end): a signal from now on is a request to exit now.
        signals.force_exit_on_signals()
        if signals.received:
            _hint_if_still_running()


def _hint_if_still_running(after_s: float = 2.0) -> None:
    """After a Ctrl-C, say why the process has not exited yet, if it has not within ``after_s``:
    a thread nothing can interrupt is finishing (daemon timer: it dies with the process)."""

    def hint() -> None:
        print(
            "asyncrl launch: waiting for a background thread to finish (e.g. the warm start); Ctrl-C again to exit now",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(after_s, hint)
    timer.daemon = True
    timer.start()


def _exit_code(result: object) -> int:
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _stopped_by_signal() -> int:
    sig = signals.received[0] if signals.received else signal.SIGINT
    print(f"asyncrl launch: stopped by {signal.Signals(sig).name}", file=sys.stderr)
    return 128 + sig


def run_script(path: str, script_args: list[str]) -> int:
    path = os.path.abspath(path)
    sys.argv = [path, *script_args]
    sys.path.insert(0, os.path.dirname(path))
    signals.received.clear()
    name = os.path.basename(path)
    try:
        if not _defines_main(path):
            runpy.run_path(path, run_name="__main__")
            return 0
        main = _load(path).main
        if inspect.iscoroutinefunction(main):
            return _exit_code(run_loop(_run_main(main)))
        result = main()
        if inspect.iscoroutine(result):
            result = run_loop(_run_main(lambda: result))
        return _exit_code(result)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return _stopped_by_signal()
    except SystemExit as e:
        if signals.received:  # the supervisor turned SIGTERM into SystemExit(128 + signal)
            return _stopped_by_signal()
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except BrokenPipeError:  # stdout's reader left (`--help | head`): stop as a filter does, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail too
        return 128 + signal.SIGPIPE
    except UsageError as e:  # the command line is wrong, not the code: no traceback
        print(f"{name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ActionableError as e:  # a setting or the machine, not the code: its line says what to change
        print(f"{name}: {one_line(e)}", file=sys.stderr)
        return 1
    except Exception:  # a bug (SyntaxError included): its traceback is what helps
        traceback.print_exc()
        return 1
    finally:
        signals.restore_signals()
