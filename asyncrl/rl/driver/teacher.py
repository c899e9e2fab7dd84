"""The driver's side of on-policy distillation: the tokenizer check before the scorer is spawned,
and `Teacher`, which has each delivered group scored by the scorer actor before it is queued.

Each sampler's pump calls `Teacher.annotate` on its groups, so the scorer sees requests from
every sampler at once and batches them (``scorer/actor.py``). A scorer that dies or overruns
``--teacher.timeout_s`` is the scorer's fault, never the sampler's: the call is retried on its
next incarnation (a silent one is killed first, so it never comes back half-alive), within the
restarts the supervisor gives it; past them the run stops, naming the scorer.
"""

from __future__ import annotations

import msgspec

from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.driver.faults import RunStoppedError
from asyncrl.rl.rollout import InvalidGroupError, RolloutGroup, validate_group


class ScorerLostError(RunStoppedError):
    """The scorer died or stopped answering and did not come back within its restarts."""


def check_tokenizers(student_path: str, teacher_path: str) -> None:
    """A `ConfigError` (one line) unless the teacher reads token ids as the student does: the same
    vocabulary (token to id) and special tokens. Compared before any actor is spawned."""
    from transformers import AutoTokenizer

    student, teacher = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (student_path, teacher_path))
    vs, vt = student.get_vocab(), teacher.get_vocab()
    if vs != vt or student.all_special_tokens != teacher.all_special_tokens:
        differ = sorted(set(vs.items()) ^ set(vt.items()))[:3]
        raise ConfigError(f"--teacher.model_path {teacher_path} has another tokenizer than the student {student_path} "
                          f"({len(vt)} vs {len(vs)} tokens; e.g. {', '.join(f'{t!r}={i}' for t, i in differ) or 'special tokens'}"
                          "): on-policy distillation scores the student's token ids, so both must share one")


class Teacher:
    """The scorer actor behind ``handle``, called under ``timeout_s`` a group; a lost one is
    awaited ``restart_timeout_s`` for its next incarnation (see the module docstring)."""

    def __init__(self, handle, *, timeout_s: float, restart_timeout_s: float, log=print):
        self.handle, self.timeout_s, self.restart_timeout_s, self.log = handle, timeout_s, restart_timeout_s, log
        self._reported = -1  # the last incarnation whose loss was logged (several pumps see the same one)

    async def annotate(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` with the teacher's log-probs of its completion tokens."""
        while True:
            info = self.handle.info()
            if info.state != "running":  # starting or restarting: its next incarnation is awaited by state
                info = await self.handle.wait_for_state(["running"], self.restart_timeout_s)
                if info.state != "running":
                    raise ScorerLostError(f"the scorer is not running ({info.state}, restarts {info.restarts}/"
                                          f"{info.max_restarts}, --run.sampler_max_restarts) within "
                                          f"--run.restart_timeout_s {self.restart_timeout_s:g} s")
            incarnation = info.incarnation
            try:
                scores = await self.handle.with_timeout(self.timeout_s).teacher_logprobs(
                    group.prompt_ids, group.completion_ids)
            except (ActorDiedError, CallTimeoutError) as exc:
                await self._await_return(incarnation, exc)
                continue
            except RemoteError as exc:  # the scorer's own refusal (ScorerError) or a bug: it would repeat
                raise RunStoppedError(f"the scorer failed on the group of prompt {group.prompt_id}: "
                                      f"{exc.remote_type}: {first_line(exc.remote_message)}") from exc
            try:
                scored = msgspec.structs.replace(group, teacher_logprobs=scores)
                validate_group(scored)
            except InvalidGroupError as exc:
                raise RunStoppedError(f"the scorer's answer does not fit the group: {exc}") from None
            return scored

    async def _await_return(self, incarnation: int, exc: Exception) -> None:
        if isinstance(exc, CallTimeoutError):
            self.handle.kill(f"no teacher log-probs within --teacher.timeout_s {self.timeout_s:g} s", incarnation)
        if incarnation != self._reported:
            self._reported = incarnation
            self.log(f"scorer (incarnation {incarnation}) lost: {first_line(exc)}; waiting for its restart")
        info = await self.handle.wait_for_incarnation(incarnation, self.restart_timeout_s)
        if info.state != "running" or info.incarnation <= incarnation:
            raise ScorerLostError(f"the scorer did not come back after incarnation {incarnation} ({info.state}, "
                                  f"restarts {info.restarts}/{info.max_restarts}, --run.sampler_max_restarts; "
                                  f"--run.restart_timeout_s {self.restart_timeout_s:g} s): {first_line(exc)}")
