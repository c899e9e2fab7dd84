"""`RunScope`: a run's directory and what lives as long as the run does around its parts: the
console (RUN_DIR/log.txt), the status server (``asyncrl status``, ``asyncrl scale``, ``--endpoint``),
the loop watch and the metrics endpoint, and the one report of a stop.

The scope exists before any actor: while the run starts, ``driver`` is None and the status says
``starting``; the builder (build.py) hands it the driver once built. Every way a run can end
passes through `RunScope.reporting_stops` once: a signal (SIGINT, SIGTERM) or any error is
recorded as a ``stopped`` event in faults.jsonl (once the run directory is ours: `commit`) and told
in one line that names what resumes the run; a full disk under the run directory becomes
`RunDirError` (saving.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Iterator
from typing import Any

from asyncrl.errors import ActionableError, first_line, one_line
from asyncrl.rl.checkpoint import Checkpoint
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.stored import write_run_config
from asyncrl.rl.driver.faults import RunStoppedError, append_event
from asyncrl.rl.driver.fleet.endpoints import sampler_endpoints
from asyncrl.rl.driver.fleet.handles import Log
from asyncrl.rl.driver.fleet.scaling import Scaler, ScaleRefusedError
from asyncrl.rl.driver.grpo import GRPODriver, Phase
from asyncrl.rl.driver.resume import resume_hint
from asyncrl.rl.driver.run_progress import StartingProgress
from asyncrl.rl.driver.saving import run_dir_error
from asyncrl.rl.observe.endpoint import MetricsEndpoint, open_endpoint
from asyncrl.rl.observe.runlog import LOG_FILE, RunLog
from asyncrl.runtime import signals
from asyncrl.runtime.loop_watch import LoopWatch
from asyncrl.runtime.status import StatusServer
from asyncrl.runtime.supervisor import Supervisor


class RunScope:
    """The run directory and the services around a run; ``async with`` opens and closes them (the
    status server, the console's tee into log.txt, the loop watch; the metrics endpoint, opened
    by `open_endpoint` where a failure to open it is a stop, is closed with them)."""

    def __init__(self, config: GRPOConfig, sup: Supervisor, log: Log):
        self.config, self.run, self.sup = config, config.run, sup
        run = config.run
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars would bury the progress line
        self.run_dir = os.path.abspath(run.run_dir or os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S")))
        os.makedirs(self.run_dir, exist_ok=True)
        self.console = RunLog(os.path.join(self.run_dir, LOG_FILE), log)
        self.log = self.console.log
        self.driver: GRPODriver | None = None  # set by the builder once the driver is built
        self.committed = False  # config.json written: from here on a stop is recorded in the run directory
        self._status: StatusServer | None = None
        self._watch: LoopWatch | None = None
        self._endpoint: MetricsEndpoint | None = None

    async def __aenter__(self) -> RunScope:
        status = self._status = await self.sup.serve_status(self.run_dir, progress=self.progress)
        status.add_command("scale", self.scale)  # asyncrl scale (fleet/scaling.py)
        # asyncrl status RUN_DIR --endpoint: each sampler's OpenAI endpoint and token (fleet/endpoints.py)
        status.add_command("endpoint", self.endpoints)
        self.console.__enter__()
        # A synchronous call on this loop would freeze every deadline and the status socket, silently.
        watch_s = self.run.observe.loop_watch_s
        self._watch = LoopWatch("the driver", watch_s, self.log).start() if watch_s else None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
        if self._watch is not None:
            self._watch.close()
        self.console.__exit__()
        if self._status is not None:
            self._status.close()

    def open_endpoint(self) -> None:
        """--run.metrics_port: /metrics, /healthz."""
        self._endpoint = open_endpoint(self.run.observe, self.sup, lambda: self.driver, self.log)

    def progress(self) -> dict[str, Any]:
        """For `asyncrl status`, called on this event loop per request (run_progress.py)."""
        if self.driver is None:
            return StartingProgress(steps=self.run.steps).to_dict()
        return self.driver.progress().to_dict()

    def scale(self, args: dict[str, object]) -> dict[str, int]:
        return _scaler_of(self.driver).request(args)

    def endpoints(self, args: dict[str, object]) -> Awaitable[dict[str, object]]:
        return sampler_endpoints(self.driver.pool.membership if self.driver is not None else None, args)

    def commit(self, checkpoint: Checkpoint | None) -> None:
        """The run is known to start (fresh) or to resume (the trainer loaded the checkpoint):
        only now is the run directory changed (a refused or failed resume leaves it as it was)."""
        write_run_config(self.config, self.run_dir)
        self.committed = True
        self.console.open(f"resumed from {checkpoint.name}" if checkpoint is not None else "new run")

    def stopped(self, cause: str, detail: str) -> tuple[str, str]:
        """Record a stop (faults.jsonl, once the run directory is ours); returns where the run
        stopped ("at step 137") and the line that says what resumes it."""
        driver = self.driver
        where = driver.where() if driver is not None else "while starting"
        hint = resume_hint(self.run_dir)
        if self.committed:
            try:
                append_event(
                    os.path.join(self.run_dir, "faults.jsonl"),
                    {
                        "event": "stopped",
                        "cause": cause,
                        "step": driver.step_done + 1 if driver is not None else 0,
                        "at": time.time(),
                        "detail": detail or f"stopped {where} by {cause}",
                        "resume": hint,  # what `asyncrl status` and `asyncrl scale` say of a stopped run
                    },
                )
            except OSError:
                pass  # a full disk: the stop itself is what the user needs to hear about
        return where, hint

    @contextlib.contextmanager
    def reporting_stops(self) -> Iterator[None]:
        """Every stop of what runs inside, reported once: recorded (`stopped`) and told in one line
        that says what resumes the run; the error the caller gets names the same."""
        try:
            yield
        except asyncio.CancelledError:  # SIGINT/SIGTERM (asyncrl launch), or a caller's cancel
            signum = signals.cancelled_by_signal(asyncio.current_task())
            cause = signal.Signals(signum).name if signum else "cancellation"
            where, hint = self.stopped(cause, "")
            self.log(f"run stopped {where} by {cause}; {hint}")
            raise
        except ConfigError:
            raise  # refused before the run began (a CheckpointError too): nothing to record or resume
        except Exception as exc:
            stop = run_dir_error(exc, self.run_dir) or exc
            if not isinstance(stop, (RunStoppedError, ActionableError)):  # a bug: its traceback follows
                where, hint = self.stopped(type(exc).__name__, first_line(exc))
                self.log(f"run stopped {where} by an error ({type(exc).__name__}); {hint}")
                raise
            # The user's to fix (a start that overran, memory that ran out: `ActionableError`, its
            # own type even from an actor) or a stop the driver already put in words: one line.
            text = str(stop) if isinstance(stop, RunStoppedError) else one_line(stop)
            where, hint = self.stopped(type(stop).__name__, text)
            message = f"run stopped {where}: {text}; {hint}"
            self.console.record(message)  # the caller prints the error; the log keeps it too, with the traceback
            self.console.record("".join(traceback.format_exception(exc)).rstrip("\n"))
            if isinstance(stop, RunStoppedError):
                raise type(stop)(message) from exc
            raise RunStoppedError(message) from exc  # ``from``: the caller still finds exc by its type


def _scaler_of(driver: GRPODriver | None) -> Scaler:
    """The run's `Scaler`, or a refusal while the run is not training yet."""
    phase = driver.phase if driver is not None else Phase.STARTING
    if driver is None or driver.scaler is None or phase is not Phase.TRAINING:
        raise ScaleRefusedError(
            f"the run is {phase.value}, not training: its samplers can be scaled while it trains "
            "(asyncrl status shows the phase)"
        )
    return driver.scaler
