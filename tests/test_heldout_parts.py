"""The held-out evaluation's parts and where they are solved, in-process and deterministic:
stand-ins for the samplers (each streams its shard's parts, from a fixed table of which problem is
solved) and for the trainer answer as the real ones do (``rl/driver/heldout.py``,
``rl/driver/fleet/evaluation.py``, ``rl/model/tally.py``; the real actors are in
test_heldout_samplers.py).

* Parts add up to the answer of one evaluation, whatever the shards: two samplers give what one
  part of every problem gives, and nothing is asked of the trainer.
* A sampler lost mid-evaluation costs nothing but time: what it left goes to the sampler still in
  the group, or with none left to the trainer, which is asked exactly the problems left.
* A part generated under another weight version is not counted, and its sampler is lost, saying so.
* The task's code past its failure budget stops the run; the sampler is not blamed for it.
* ``--run.eval_on auto`` picks the samplers where they run vLLM on a GPU, and says so.
* Progress lines: problems done of the total in each pass and the rate; the trainer's own count
  asked for before each line while it solves.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from asyncrl import ActorState
from asyncrl.errors import ActorDiedError, RemoteError, remote_error_class, type_path
from asyncrl.rl.config.run import DataConfig, DeadlineConfig, RecoveryConfig, RunConfig
from asyncrl.rl.driver import heldout
from asyncrl.rl.driver.faults import TaskFailedError
from asyncrl.rl.driver.fleet.membership import Membership, MemberState
from asyncrl.rl.model.tally import HeldoutPart, Tally, heldout_answer
from asyncrl.rl.observe.eval_progress import EvalProgress
from asyncrl.rl.tasks.scoring import TaskFailureError

pytestmark = pytest.mark.timeout(60)
N, SAMPLES = 10, 2


def solved(i: int, sampled: bool) -> Tally:
    """The table every stand-in solves by: problem ``i``'s episodes in a pass."""
    n = SAMPLES if sampled else 1
    correct = n if i % 3 == 0 else (1 if sampled and i % 2 else 0)
    return Tally(episodes=n, correct=correct, metrics={"length": float(i * n)}, errors={"raised": 1} if i == 7 else {})


def part_of(problems: list[int], sampled: bool, version: int) -> HeldoutPart:
    found = Tally()
    for i in problems:
        found = found + solved(i, sampled)
    return HeldoutPart(sampled, problems, found, [version])


def expected() -> dict:
    """What one part of every problem, in each pass, answers."""
    return heldout_answer([part_of(list(range(N)), False, 0), part_of(list(range(N)), True, 0)], SAMPLES)


class Solver:
    """Stands in for a sampler's handle: ``evaluate_heldout`` streams parts of two problems from
    the table, greedy first. ``fail_after``: parts delivered before ``error`` is raised instead."""

    def __init__(
        self, name: str, *, fail_after: int | None = None, error: BaseException | None = None, version=None, engine=""
    ):
        self.name, self.fail_after, self.error, self.version = name, fail_after, error, version
        self.engine = engine  # "backend device", as its stats say
        self.state, self.incarnation = "running", 1
        self.asked: list[tuple[list[int], list[int]]] = []
        self.kills: list[str] = []

    def info(self) -> SimpleNamespace:
        return SimpleNamespace(state=ActorState(self.state), incarnation=self.incarnation, restarts=0, max_restarts=3)

    def kill(self, reason: str, incarnation: int | None = None) -> bool:
        self.kills.append(reason)
        self.state = "restarting"
        return True

    async def wait_for_incarnation(self, after: int, timeout_s: float) -> SimpleNamespace:
        return self.info()  # never back within this test's evaluation

    def with_timeout(self, timeout_s: float) -> Solver:
        return self

    def pinned(self, incarnation: int) -> Solver:
        return self

    async def stats(self) -> SimpleNamespace:
        backend, device = self.engine.split()
        # as a sampler says it: an engine that batches requests itself (vLLM's), on a GPU
        serves = backend == "vllm" and device.startswith("cuda")
        return SimpleNamespace(backend=backend, device=device, serves_evaluations=serves)

    async def evaluate_heldout(self, greedy, sampled, samples, max_new_tokens, rows):
        self.asked.append((list(greedy), list(sampled)))
        chunks = [(False, greedy[i : i + 2]) for i in range(0, len(greedy), 2)]
        chunks += [(True, sampled[i : i + 2]) for i in range(0, len(sampled), 2)]
        for k, (is_sampled, problems) in enumerate(chunks):
            if self.fail_after is not None and k >= self.fail_after:
                if isinstance(self.error, ActorDiedError):
                    self.state = "restarting"
                raise self.error
            await asyncio.sleep(0)
            yield part_of(problems, is_sampled, self.version if self.version is not None else VERSION)


class Trainer:
    """Stands in for the trainer's handle: solves what it is asked from the same table."""

    def __init__(self):
        self.asked: list[tuple[list[int], list[int]]] = []
        self.name = "trainer"

    def with_timeout(self, timeout_s: float) -> Trainer:
        return self

    async def evaluate_heldout(self, ask):  # a `HeldoutAsk`, as the trainer's ranks are asked
        greedy, sampled = ask.greedy, ask.sampled
        self.asked.append((list(greedy), list(sampled)))
        return [p for p in (part_of(greedy, False, VERSION), part_of(sampled, True, VERSION)) if p.problems]

    async def heldout_progress(self) -> list[int]:
        return [0, 0]


VERSION = 4


def run_config() -> RunConfig:
    return RunConfig(
        eval_samples=SAMPLES,
        eval_on="samplers",
        data=DataConfig(n_heldout=N),
        deadlines=DeadlineConfig(generate_timeout_s=5.0, queue_timeout_s=10.0, eval_timeout_s=10.0),
        recovery=RecoveryConfig(restart_timeout_s=1.0),
    )


def members_of(*handles) -> Membership:
    members = Membership(list(handles), [0] * len(handles), recovery=run_config().recovery, log=lambda _: None)
    for m in members.members:  # as after a successful start: in the group, incarnation 1
        m.state, m.incarnation = MemberState.JOINED, 1
    return members


async def evaluate(members: Membership | None, trainer: Trainer, logs: list[str]) -> heldout.Evaluated:
    return await heldout.evaluate(trainer, run_config(), logs.append, version=VERSION, members=members)


def remote(cls: type, message: str) -> RemoteError:
    return remote_error_class(cls.__name__, type_path(cls))("sampler1", "evaluate_heldout", cls.__name__, message)


def split(answer: dict) -> tuple[dict, dict]:
    """An answer as `heldout.evaluate` returns it: the rates, and the rest under ``heldout/``."""
    return (
        {k: v for k, v in answer.items() if "/" not in k},
        {f"heldout/{k}": v for k, v in answer.items() if "/" in k},
    )


WHO = "sampler0, sampler1"


async def test_two_samplers_shards_add_up_to_one_evaluation_and_the_trainer_is_not_asked():
    a, b, trainer, logs = Solver("sampler0"), Solver("sampler1"), Trainer(), []
    found = await evaluate(members_of(a, b), trainer, logs)
    assert (found.rates, found.extra) == split(expected())
    assert found.rates == {"greedy": 0.4, "sampled": 11 / 20}  # 0, 3, 6, 9 always; 1, 5 once of two
    assert found.extra["heldout/task_errors/raised"] == 2.0  # problem 7, in both passes
    assert a.asked == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])] and b.asked == [([5, 6, 7, 8, 9], [5, 6, 7, 8, 9])]
    assert not trainer.asked and not a.kills and not b.kills
    assert logs == [
        f"held-out evaluation of v4: 10 problems greedy and 10 x 2 sampled in {found.seconds:.1f} s on {WHO}"
    ]


async def test_a_sampler_lost_mid_evaluation_leaves_its_rest_to_the_other():
    died = ActorDiedError("sampler1", "killed by SIGKILL")
    a, b, trainer, logs = Solver("sampler0"), Solver("sampler1", fail_after=1, error=died), Trainer(), []
    members = members_of(a, b)
    found = await evaluate(members, trainer, logs)
    assert (found.rates, found.extra) == split(expected())
    # sampler1 delivered greedy 5 and 6, then died: the rest of its shard went to sampler0
    assert a.asked == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]), ([7, 8, 9], [5, 6, 7, 8, 9])]
    assert not trainer.asked
    assert not members.members[1].in_group and members.counters["sampler_losses"] == 1
    await members.close()
    assert members.faults[0].cause == "died during the held-out evaluation of v4 (killed by SIGKILL)"
    assert (
        f"the held-out evaluation of v{VERSION}: what sampler1 left unsolved goes to the samplers still in the group"
        in logs
    )


async def test_with_no_sampler_left_the_trainer_solves_exactly_what_is_left():
    lost = Solver("sampler0", fail_after=3, error=ActorDiedError("sampler0", "exit code 1"))
    trainer, logs, members = Trainer(), [], members_of(lost)
    found = await evaluate(members, trainer, logs)
    assert (found.rates, found.extra) == split(expected())
    assert trainer.asked == [([6, 7, 8, 9], list(range(N)))]  # 3 parts of 2 greedy problems came first
    assert logs[-1].endswith("on sampler0 and the trainer")
    await members.close()


async def test_a_part_of_another_version_is_not_counted_and_its_sampler_is_lost_saying_so():
    stale, good, trainer, logs = Solver("sampler0", version=VERSION - 1), Solver("sampler1"), Trainer(), []
    members = members_of(stale, good)
    found = await evaluate(members, trainer, logs)
    assert (found.rates, found.extra) == split(expected())
    assert stale.kills and "evaluated held-out problems under weight version(s) v3, not v4" in stale.kills[0]
    assert not members.members[0].in_group and members.counters["sampler_losses"] == 1
    assert good.asked[1] == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]) and not trainer.asked
    await members.close()


async def test_the_task_failing_past_its_budget_stops_the_run_without_blaming_the_sampler():
    failing = Solver("sampler1", fail_after=0, error=remote(TaskFailureError, "task countdown: 9 of 10 failed"))
    members = members_of(Solver("sampler0"), failing)
    with pytest.raises(TaskFailedError, match="the held-out evaluation of v4 on sampler1: task countdown: 9 of 10"):
        await evaluate(members, Trainer(), [])
    assert not failing.kills and members.members[1].state is MemberState.JOINED


async def test_the_trainer_alone_when_no_sampler_is_given():
    trainer, logs = Trainer(), []
    found = await evaluate(None, trainer, logs)
    assert (found.rates, found.extra) == split(expected())
    assert trainer.asked == [(list(range(N)), list(range(N)))]
    assert logs[-1].endswith("on the trainer")


def test_failures_of_one_kind_from_two_parts_are_one_line():
    first = Tally(episodes=2, failures={"raised ValueError: no raise": 1, "timeout agent ran past its 5 s deadline": 1})
    second = Tally(episodes=2, failures={"raised ValueError: no raise 2": 2})
    assert (first + second).failures == {"raised ValueError: no raise": 3, "timeout agent ran past its 5 s deadline": 1}
    assert (first + second).episodes == 4 and Tally().solve_rate == 0.0 and Tally().means() == {}


async def test_progress_lines_say_problems_done_of_the_total_and_the_rate():
    now, logs = [100.0], []
    progress = EvalProgress(500, 4, 12, "sampler0, sampler1", logs.append, clock=lambda: now[0])
    progress.add(HeldoutPart(False, list(range(300)), Tally()))
    now[0] += 20.0
    await progress.tick()
    assert logs[-1] == (
        "held-out evaluation of v12 on sampler0, sampler1: greedy 300/500, sampled 0/500 problems, 15.0 a second, 20 s"
    )
    # the trainer solving the rest: its own count asked for before the line
    progress.where += " and the trainer"

    async def poll() -> list[int]:
        return [200, 100]

    progress.poll = poll
    now[0] += 20.0
    await progress.tick()
    assert logs[-1].endswith(": greedy 500/500, sampled 100/500 problems, 15.0 a second, 40 s")
    assert progress.progress().to_dict() == {
        "version": 12,
        "on": "sampler0, sampler1 and the trainer",
        "greedy": [500, 500],
        "sampled": [100, 500],
        "seconds": 40.0,
    }
    progress.trainer_done([HeldoutPart(False, list(range(200)), Tally()), HeldoutPart(True, list(range(500)), Tally())])
    assert progress.solved() == (500, 500) and progress.poll is None


@pytest.mark.parametrize(
    "eval_on, engines, on_samplers, line",
    [
        (
            "auto",
            ["vllm cuda:0", "vllm cuda:0"],
            True,
            "on the samplers (--run.eval_on auto; samplers: vllm on cuda:0)",
        ),
        ("auto", ["hf cpu"], False, "on the trainer (--run.eval_on auto; samplers: hf on cpu)"),
        ("auto", ["vllm cpu"], False, "on the trainer (--run.eval_on auto; samplers: vllm on cpu)"),
        ("samplers", ["hf cpu"], True, "on the samplers (--run.eval_on samplers)"),
        ("trainer", ["vllm cuda:0"], False, "on the trainer (--run.eval_on trainer)"),
    ],
)
async def test_where_the_evaluations_run_is_said_once(eval_on, engines, on_samplers, line):
    logs: list[str] = []
    members = members_of(*(Solver(f"sampler{i}", engine=e) for i, e in enumerate(engines)))
    run = dataclasses.replace(run_config(), eval_on=eval_on)
    assert await heldout.eval_place(members, run, logs.append) is on_samplers
    assert logs == [f"held-out evaluations {line}"]
