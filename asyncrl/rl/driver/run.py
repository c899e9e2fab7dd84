"""`train()`: one GRPO run from its config to its summary, or to a stop that says how to resume.

It reads as the algorithm: check the config (`preflight.check_run`), plan where the actors go
(spawn.py: the device plan, the placement, the weight check's backends), open the run's scope
(run_scope.py: the run directory, its console and status, the one report of a stop), build the
run's parts (build.py: the trainer's ranks, the scorers, the samplers, a checkpoint to resume from,
the driver), and run the steps (`GRPODriver.execute`, grpo.py). Every way a run can end passes
through `RunScope.reporting_stops` once: a signal (SIGINT, SIGTERM) or any error is recorded as a
``stopped`` event in faults.jsonl and told in one line that names what resumes the run; a full
disk under the run directory becomes `RunDirError` (saving.py).
"""

from __future__ import annotations

from typing import Any

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.driver.build import build_run
from asyncrl.rl.driver.fleet.handles import Log
from asyncrl.rl.driver.run_scope import RunScope
from asyncrl.rl.driver.spawn import plan_run
from asyncrl.runtime.supervisor import Supervisor


async def train(config: GRPOConfig, sup: Supervisor, *, log: Log = print, resume: bool = False) -> dict[str, Any]:
    """Run GRPO with ``config`` on the actors of ``sup``; returns the summary (also in the run dir).
    ``resume``: continue the run in ``config.run.run_dir`` from its newest good checkpoint (checked
    against its manifest; a damaged one is skipped, and said so). Raises a `RunStoppedError` (its
    message names the cause and ends with how to resume) if the run cannot go on, a
    `CheckpointError` (one line) if there is nothing good to resume from. On every stop, a
    signal included, one line says what can be resumed and faults.jsonl gets a ``stopped``
    event. What the console shows is kept in RUN_DIR/log.txt (`RunLog`)."""
    from asyncrl.rl.driver.preflight import check_run

    config = check_run(config, resume=resume)  # paths and limits, before anything is spawned or written
    plan = await plan_run(config, sup)  # the devices and nodes of every actor, before the run directory
    async with RunScope(config, sup, log) as scope:  # the run directory, log.txt, `asyncrl status`
        with scope.reporting_stops():  # faults.jsonl's ``stopped`` and the line that says how to resume
            scope.open_endpoint()
            scope.driver = await build_run(config, sup, plan, scope, resume=resume)
            return await scope.driver.execute()
