"""The driver's side of the scorer actors: the tokenizer check before one is spawned (what it is
spawned with is its `ScorerSpec`, ``rl/scorer/specs.py``); `Teacher`, which has each delivered
group scored by a teacher before it is queued (on-policy distillation), and `RewardModel`, which
adds a reward model's (or a judge's) score to the task's reward.

Each sampler's pump calls `Teacher.annotate` on its groups, so the scorer sees requests from
every sampler at once and batches them (``scorer/actor.py``). A scorer that dies or overruns
``--teacher.timeout_s`` is the scorer's fault, never the sampler's: the call is retried on its
next incarnation (a silent one is killed first, so it never comes back half-alive), within the
restarts the supervisor gives it; past them the run stops, naming the scorer.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec

from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.teacher import RewardModelConfig, TeacherConfig
from asyncrl.rl.driver.faults import RunStoppedError
from asyncrl.rl.driver.fleet.handles import Log, ScorerHandle
from asyncrl.rl.rollout import InvalidGroupError, RolloutGroup, validate_group
from asyncrl.runtime.state import ActorState

if TYPE_CHECKING:
    from asyncrl.rl.rollout import TeacherTopK

T = TypeVar("T")


class ScorerLostError(RunStoppedError):
    """The scorer died or stopped answering and did not come back within its restarts."""


def check_tokenizers(student_path: str, teacher_path: str, flag: str = "--teacher.model_path") -> None:
    """A `ConfigError` (one line) unless the scorer's model at ``teacher_path`` (``flag``) reads
    token ids as the student does: the same vocabulary (token to id) and special tokens.
    Compared before any actor is spawned."""
    from transformers import AutoTokenizer

    student, teacher = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (student_path, teacher_path))
    vs, vt = student.get_vocab(), teacher.get_vocab()
    if vs != vt or student.all_special_tokens != teacher.all_special_tokens:
        differ = sorted(set(vs.items()) ^ set(vt.items()))[:3]
        raise ConfigError(
            f"{flag} {teacher_path} has another tokenizer than the student {student_path} "
            f"({len(vt)} vs {len(vs)} tokens; e.g. {', '.join(f'{t!r}={i}' for t, i in differ) or 'special tokens'}"
            "): it scores the student's token ids, so both must share one"
        )


class ScorerCalls:
    """Calls to the scorer actor behind ``handle`` (``name`` in messages), each under
    ``timeout_s``; a lost one is awaited ``restart_timeout_s`` for its next incarnation and the
    call made again (see the module docstring)."""

    def __init__(
        self,
        handle: ScorerHandle,
        *,
        timeout_s: float,
        restart_timeout_s: float,
        log: Log = print,
        name: str = "scorer",
        timeout_flag: str = "--teacher.timeout_s",
    ):
        self.handle, self.timeout_s, self.restart_timeout_s, self.log = handle, timeout_s, restart_timeout_s, log
        self.name, self.timeout_flag = name, timeout_flag
        self._reported = -1  # the last incarnation whose loss was logged (several pumps see the same one)

    async def call(self, request: Callable[[ScorerHandle], Awaitable[T]], group: RolloutGroup) -> T:
        """``request`` made of the scorer (its handle, with this deadline) for ``group``."""
        while True:
            info = self.handle.info()
            if info.state != ActorState.RUNNING:  # starting or restarting: its next incarnation is awaited by state
                info = await self.handle.wait_for_state([ActorState.RUNNING], self.restart_timeout_s)
                if info.state != ActorState.RUNNING:
                    raise ScorerLostError(
                        f"the {self.name} is not running ({info.state}, restarts {info.restarts}/"
                        f"{info.max_restarts}, --run.sampler_max_restarts) within "
                        f"--run.restart_timeout_s {self.restart_timeout_s:g} s"
                    )
            incarnation = info.incarnation
            try:
                return await request(self.handle.with_timeout(self.timeout_s))
            except (ActorDiedError, CallTimeoutError) as exc:
                await self._await_return(incarnation, exc)
            except RemoteError as exc:  # the scorer's own refusal (ScorerError) or a bug: it would repeat
                raise RunStoppedError(
                    f"the {self.name} failed on the group of prompt {group.prompt_id}: "
                    f"{exc.remote_type}: {first_line(exc.remote_message)}"
                ) from exc

    async def _await_return(self, incarnation: int, exc: Exception) -> None:
        if isinstance(exc, CallTimeoutError):
            self.handle.kill(f"no answer within {self.timeout_flag} {self.timeout_s:g} s", incarnation)
        if incarnation != self._reported:
            self._reported = incarnation
            self.log(f"{self.name} (incarnation {incarnation}) lost: {first_line(exc)}; waiting for its restart")
        info = await self.handle.wait_for_incarnation(incarnation, self.restart_timeout_s)
        if info.state != ActorState.RUNNING or info.incarnation <= incarnation:
            raise ScorerLostError(
                f"the {self.name} did not come back after incarnation {incarnation} ({info.state}, "
                f"restarts {info.restarts}/{info.max_restarts}, --run.sampler_max_restarts; "
                f"--run.restart_timeout_s {self.restart_timeout_s:g} s): {first_line(exc)}"
            )


class Teacher(ScorerCalls):
    """On-policy distillation's teacher (``--teacher.*``): each group gets its log-probs of the
    sampled tokens (``teacher_logprobs``), or with ``top_k`` > 0 its K most likely tokens and their
    log-probs at every completion position (``teacher_topk_*``)."""

    def __init__(self, handle: ScorerHandle, config: TeacherConfig, *, restart_timeout_s: float, log: Log = print):
        super().__init__(handle, timeout_s=config.timeout_s, restart_timeout_s=restart_timeout_s, log=log)
        self.top_k = config.top_k

    async def annotate(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` with the teacher's log-probs of its completion tokens (or top-K)."""
        ids, completions = group.prompt_ids, group.completion_ids
        if not self.top_k:
            return _fitted(
                group, teacher_logprobs=await self.call(lambda h: h.teacher_logprobs(ids, completions), group)
            )
        topk: TeacherTopK = await self.call(lambda h: h.teacher_topk(ids, completions), group)
        return _fitted(group, teacher_top_k=topk.k, teacher_topk_ids=topk.ids, teacher_topk_logprobs=topk.logprobs)


class UnparsedVerdictsError(RunStoppedError):
    """Too many of a judge's verdicts did not parse for its scores to mean anything."""


class RewardModel(ScorerCalls):
    """A reward model's scores (``--reward_model.*``) combined with the task's: ``reward =
    rule_weight * rule + weight * model`` per completion. A judge's (``judge``: its verdicts may not
    parse) unparsed verdict (None) adds 0 and is counted; more than ``max_unparsed_rate`` of them,
    after ``min_verdicts``, stop the run."""

    def __init__(
        self,
        handle: ScorerHandle,
        config: RewardModelConfig,
        *,
        judge: bool = False,
        restart_timeout_s: float,
        log: Log = print,
        min_verdicts: int = 50,
    ):
        super().__init__(
            handle,
            timeout_s=config.timeout_s,
            restart_timeout_s=restart_timeout_s,
            log=log,
            name="reward model",
            timeout_flag="--reward_model.timeout_s",
        )
        weight, rule_weight, max_unparsed_rate = config.weight, config.rule_weight, config.max_unparsed_rate
        self.weight, self.rule_weight, self.judge = weight, rule_weight, judge
        self.max_unparsed_rate, self.min_verdicts = max_unparsed_rate, min_verdicts
        self.verdicts = self.unparsed = 0  # over the run
        self._counts = {"judged": 0, "judge_unparsed": 0}  # since the last take_counts

    async def annotate(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` with its rewards the weighted sum of the task's and the reward model's."""
        scores = await self.call(lambda h: h.rewards(group.prompt_ids, group.completion_ids), group)
        if len(scores) != len(group.rewards) or not all(s is None or math.isfinite(s) for s in scores):
            raise RunStoppedError(
                f"the reward model gave {scores!r} for the {len(group.rewards)} completions of "
                f"prompt {group.prompt_id}: one finite score per completion is needed"
            )
        unparsed = sum(s is None for s in scores)
        if unparsed and not self.unparsed:
            self.log(
                f"reward model: {unparsed} of the judge's verdicts on prompt {group.prompt_id} did not parse "
                "(counted as 0; see --reward_model.verdict, --reward_model.template; metric judge_unparsed)"
            )
        self.verdicts += len(scores)
        self.unparsed += unparsed
        self._counts["judged"] += len(scores)
        self._counts["judge_unparsed"] += unparsed
        if self.verdicts >= self.min_verdicts and self.unparsed / self.verdicts > self.max_unparsed_rate:
            raise UnparsedVerdictsError(
                f"{self.unparsed} of the judge's {self.verdicts} verdicts did not parse "
                f"({self.unparsed / self.verdicts:.0%}, more than --reward_model.max_unparsed_rate "
                f"{self.max_unparsed_rate:g}): fix --reward_model.verdict or the template's instructions "
                "(--reward_model.template)"
            )
        return _fitted(
            group, rewards=[self.rule_weight * r + self.weight * (s or 0.0) for r, s in zip(group.rewards, scores)]
        )

    def take_counts(self) -> dict[str, int]:
        """Verdicts and unparsed ones since the previous take, for the step's metrics (a judge's only)."""
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts if self.judge else {}


def _fitted(group: RolloutGroup, **fields: object) -> RolloutGroup:
    try:
        scored = msgspec.structs.replace(group, **fields)
        validate_group(scored)
    except InvalidGroupError as exc:
        raise RunStoppedError(f"a scorer's answer does not fit the group: {exc}") from None
    return scored
