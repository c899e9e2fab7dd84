"""The held-out evaluation between steps, and the best policy it finds.

`evaluate` solves the held-out problems under ``--run.eval_timeout_s``, on the trainer or on the
samplers (``--run.eval_on``, resolved once by `eval_place`): on the samplers each one in the
weight-sync group takes a shard (``fleet/evaluation.py``) and what a lost one left goes to the
others, or, with none left, to the trainer; on the trainer it is one call. Either way the parts
(`HeldoutPart`: sums and counts) add up to the same answer (`heldout_answer`), split here into
the solve rates and the task's own metrics; the console says how far it has got while it runs
(`EvalProgress`). The policy of the best held-out greedy solve rate so far is kept in
RUN_DIR/best/ with best.json inside (`save_best`); a resumed run reads it back (`read_best`), since
it may be newer than the checkpoint resumed from. `HeldoutRecord` is what the driver keeps of
them over a run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from asyncrl.errors import RemoteError
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.faults import PhaseTimeoutError, TaskFailedError, trainer_phase
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.driver.fleet.evaluation import Unsolved, solve_on_samplers
from asyncrl.rl.driver.fleet.membership import Membership, MemberState
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks
from asyncrl.rl.driver.run_state import RunState
from asyncrl.rl.driver.saving import save_policy
from asyncrl.rl.model.tally import HeldoutAsk, HeldoutPart, heldout_answer
from asyncrl.rl.observe.eval_progress import EvalProgress
from asyncrl.rl.observe.record import StepRecord
from asyncrl.rl.observe.report import heldout_extra_text, heldout_failures_lines, rates_text, shown_path
from asyncrl.rl.tasks.scoring import TaskFailureError
from asyncrl.runtime.timeouts import timeout

BEST_DIR, BEST_JSON = "best", "best.json"
EVAL_ROWS = 64
"""Sequences a part of an evaluation generates at once (the trainer's batch, a sampler's part)."""


class Evaluated(NamedTuple):
    """What `evaluate` found."""

    rates: dict[str, float]
    """``greedy`` and (with ``--run.eval_samples``) ``sampled`` solve rates."""
    extra: dict[str, float]
    """``heldout/task/<name>`` and ``heldout/task_errors/<kind>``: the step record's."""
    seconds: float
    """Its wall time."""


async def eval_place(members: Membership, run: RunConfig, log: Callable[[str], None]) -> bool:
    """Whether the held-out evaluations run on the samplers (``--run.eval_on``; ``auto``: when a
    sampler in the group runs vLLM on a GPU, asked of each through its ``stats``). Said in one line."""
    joined = members.with_state(MemberState.JOINED)
    if run.eval_on == "auto":
        answers = await call_all(
            [m.handle for m in joined],
            lambda h, _: h.stats(),
            timeout_s=run.observe.health_timeout_s,
            what="where the evaluation runs",
        )
        kinds = [a for a in answers.results if not isinstance(a, BaseException)]
        engines = sorted({f"{a.backend} on {a.device}" for a in kinds}) or ["none answering"]
        on_samplers = any(a.serves_evaluations for a in kinds)
        where = "the samplers" if on_samplers else "the trainer"
        log(f"held-out evaluations on {where} (--run.eval_on auto; samplers: {', '.join(engines)})")
        return on_samplers
    log(f"held-out evaluations on the {run.eval_on} (--run.eval_on {run.eval_on})")
    return run.eval_on == "samplers"


async def evaluate(
    trainer: TrainerRanks,
    run: RunConfig,
    log: Callable[[str], None],
    *,
    version: int,
    members: Membership | None = None,
    shown: Callable[[EvalProgress | None], None] = lambda _: None,
) -> Evaluated:
    """The held-out solve rates of ``version`` (the trainer's weights, which every sampler in the
    group holds: grpo.py syncs an evaluated step), and the evaluation's task metrics and failed
    calls; an agent's failed episodes are logged, a line per kind with what it raised, so a count
    of failures says why. ``members``: the samplers solve it (else the trainer); a sampler lost on
    the way costs nothing but time. The task's code failing past its budget stops the run, as in a
    sampler; so does the evaluation overrunning ``--run.eval_timeout_s``. ``shown``: handed the
    progress while it runs (None after), for ``asyncrl status``."""
    t, samples = run.deadlines.eval_timeout_s, run.eval_samples
    n = run.data.n_heldout
    unsolved = Unsolved(n, samples)
    samplers = members.with_state(MemberState.JOINED) if members is not None else []
    where = ", ".join(m.handle.name for m in samplers) or "the trainer"
    progress = EvalProgress(n, samples, version, where, log)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + t
    parts: list[HeldoutPart] = []
    shown(progress)
    ticker = asyncio.ensure_future(progress.run())
    try:
        if members is not None and samplers:
            try:
                async with timeout(t):
                    parts += await solve_on_samplers(
                        members,
                        unsolved,
                        samples=samples,
                        version=version,
                        rows=EVAL_ROWS,
                        item_timeout_s=min(run.deadlines.generate_timeout_s, t),
                        on_part=progress.add,
                        log=log,
                    )
            except (asyncio.TimeoutError, TimeoutError):
                raise PhaseTimeoutError(
                    f"the held-out evaluation of v{version} on {where} did not finish within "
                    f"--run.eval_timeout_s {t:g} s ({progress.line()})"
                ) from None
        if unsolved:
            left = max(deadline - loop.time(), 1e-3)
            greedy, sampled = sorted(unsolved.left[False]), sorted(unsolved.left[True])
            if samplers:
                progress.where += " and the trainer"
            progress.poll = trainer.with_timeout(run.observe.health_timeout_s).heldout_progress
            got = await trainer_phase(
                "the held-out evaluation",
                "eval_timeout_s",
                t,
                trainer.with_timeout(left).evaluate_heldout(
                    HeldoutAsk(greedy=greedy, sampled=sampled, samples=samples, rows=EVAL_ROWS)
                ),
            )
            progress.trainer_done(got)
            parts += got
    except RemoteError as exc:
        if isinstance(exc, TaskFailureError):  # the task's code past its budget (as fleet/pool.py: a sampler's)
            raise TaskFailedError(f"the held-out evaluation: {exc.remote_message}") from exc
        raise
    finally:
        progress.end()
        await asyncio.gather(ticker, return_exceptions=True)
        shown(None)
    log(progress.end_line())
    out = heldout_answer(parts, samples)
    failures = out.pop("failures", {})
    for line in heldout_failures_lines(failures if isinstance(failures, dict) else {}):
        log(line)
    rates = {k: v for k, v in out.items() if not isinstance(v, dict)}  # all of them, "failures" popped
    extra = {f"heldout/{k}": v for k, v in rates.items() if "/" in k}
    return Evaluated({k: v for k, v in rates.items() if "/" not in k}, extra, progress.seconds())


async def save_best(
    trainer: TrainerRanks,
    run: RunConfig,
    run_dir: str,
    step: int,
    heldout: dict[str, float],
    heldout_before: dict[str, float],
    n_heldout: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """RUN_DIR/best/: the policy of the best held-out greedy solve rate so far, with best.json
    (its step and rates) inside, written with it in one rename; returns best.json's contents."""
    best = {
        "step": step,
        "heldout": dict(heldout),
        "heldout_before": dict(heldout_before),
        "heldout_problems": n_heldout,
        "saved_at": time.time(),
    }
    await save_policy(
        trainer,
        run,
        os.path.join(run_dir, BEST_DIR),
        f"saving the best policy (step {step})",
        {BEST_JSON: json.dumps(best, indent=2)},
    )
    log(
        f"best held-out greedy so far at step {step} ({heldout['greedy']:.3f}): "
        f"saved to {shown_path(os.path.join(run_dir, BEST_DIR))}"
    )
    return best


def read_best(run_dir: str) -> dict[str, Any] | None:
    """best/best.json of an earlier segment (None if there is none, or none readable)."""
    try:
        with open(os.path.join(run_dir, BEST_DIR, BEST_JSON)) as f:
            best = json.load(f)
        float(best["heldout"]["greedy"]), int(best["step"])
        return best
    except (OSError, ValueError, KeyError, TypeError):
        return None


class HeldoutRecord:
    """A run's held-out evaluations between its steps, as the driver keeps them: where they run
    (`place`), the solve rates before GRPO (``before``) and at the last one (``last``), the latest's
    task metrics and wall time, the one under way (``under_way``, for ``asyncrl status``) and the
    best policy saved (``best``, best.json's contents). A resumed run starts from its checkpoint's
    rates and from best/best.json."""

    def __init__(
        self,
        trainer: TrainerRanks,
        run: RunConfig,
        run_dir: str,
        log: Callable[[str], None],
        state: RunState,
        *,
        resumed: bool,
    ):
        """``state``: the run's so far (the checkpoint's of a resumed run)."""
        self.trainer, self.run, self.run_dir, self.log = trainer, run, run_dir, log
        self.problems = run.data.n_heldout  # the trainer holds them
        self.before, self.last = dict(state.heldout_before), dict(state.heldout_last)
        self.extra: dict[str, float] = {}  # the latest evaluation's task metrics (`Evaluated.extra`)
        self.seconds = 0.0  # the latest evaluation's wall time
        self.on_samplers = False  # resolved once the samplers are up (`place`)
        self.members: Membership | None = None  # the samplers that evaluate, when they do
        self.under_way: EvalProgress | None = None  # for the status while one runs
        self.best = read_best(run_dir) if resumed else None  # it may be newer than the checkpoint

    async def place(self, members: Membership) -> None:
        """Where the evaluations run (`eval_place`): the samplers in the group of ``members``, or
        the trainer. Asked once the samplers are up."""
        self.on_samplers = await eval_place(members, self.run, self.log)
        self.members = members if self.on_samplers else None

    def due(self, step: int) -> bool:
        """Whether an evaluation follows ``step``."""
        return step % self.run.eval_every == 0 or step == self.run.steps

    async def evaluate(self, version: int) -> dict[str, float]:
        """The held-out solve rates of ``version``, the trainer's weights (where the samplers
        evaluate, they hold them: the driver syncs a step that is evaluated, and no sync runs while
        this is awaited). Its task metrics go to ``extra``, its time to ``seconds``."""

        def shown(progress: EvalProgress | None) -> None:
            self.under_way = progress

        found = await evaluate(self.trainer, self.run, self.log, version=version, members=self.members, shown=shown)
        self.extra, self.seconds = found.extra, found.seconds
        return found.rates

    async def before_grpo(self, version: int) -> None:
        """The solve rates before GRPO (a fresh run's), said in one line."""
        self.before = self.last = await self.evaluate(version)
        self.log(
            f"held-out solve rate before GRPO ({self.problems} problems): "
            + rates_text(self.before)
            + heldout_extra_text(self.extra)
        )

    async def after_step(self, version: int, record: StepRecord) -> None:
        """The evaluation after a step (of its weights, ``version``), into the step's ``record``."""
        self.last = await self.evaluate(version)
        record.heldout_solve_rate = self.last["greedy"]
        record.heldout_sampled_solve_rate = self.last.get("sampled")
        record.heldout_task = self.extra
        record.eval_s = self.seconds

    def best_greedy(self) -> float:
        """The held-out greedy solve rate to beat: the best saved, else the policy's before GRPO."""
        if self.best is not None:
            return self.best["heldout"]["greedy"]
        return self.before.get("greedy", -1.0)

    async def save_best(self, step: int) -> None:
        """RUN_DIR/best/: the policy of step ``step``, whose evaluation was the last (`save_best`)."""
        self.best = await save_best(
            self.trainer, self.run, self.run_dir, step, self.last, self.before, self.problems, self.log
        )
