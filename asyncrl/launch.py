"""Run a user script the way ``asyncrl launch`` promises: its ``main()`` (sync or async) under
uvloop when available, with SIGINT/SIGTERM turned into cancellation so ``async with Supervisor()``
stops every actor before we exit with ``128 + signal``. A script without a ``main`` function runs
as ``__main__``, exactly as ``python script.py`` would."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import os
import runpy
import signal
import sys
import traceback

from .runtime import signals
from .runtime.loop import run as run_loop
from .runtime.worker import SCRIPT_MODULE


def _defines_main(path: str) -> bool:
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main" for node in tree.body
    )


def _load(path: str):
    spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCRIPT_MODULE] = module  # actor classes defined in the script resolve to this file
    spec.loader.exec_module(module)
    return module


async def _run_main(main) -> object:
    task = asyncio.ensure_future(main())
    with signals.cancel_on_signals(task):
        return await task


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
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except SyntaxError:
        traceback.print_exc()
        return 1
    except Exception:
        traceback.print_exc()
        return 1
