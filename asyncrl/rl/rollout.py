"""Rollouts as they travel sampler -> driver, and the driver's bounded, staleness-aware queue.

A sampler pushes one ``RolloutGroup`` per prompt (``group_size`` completions); the GRPO loop takes
batches of groups from the ``RolloutQueue`` with ``get_batch``. The queue is where asynchrony is
bounded twice: in space (``capacity``: producers wait when it is full) and in time
(``max_staleness``: a group generated more than that many weight versions ago is dropped, and
counted, instead of trained on). ``max_staleness=0`` on a drained queue is the synchronous
baseline, run by this same code.
"""

from __future__ import annotations

import math

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.rl.generation import VersionSpan


class RolloutGroup(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """One prompt and its ``group_size`` completions, as sampled.

    ``version`` is the weight version the group's generation began under: the OLDEST version any
    of its tokens was sampled under. A completion that spans weight updates (a sampler that swaps
    weights between decoding steps keeps generating it) says which tokens each version sampled in
    ``version_spans``; `token_versions` gives one version per token either way.

    On the wire the fields are positional (``array_like``): append new fields, with defaults, at
    the end only; a shorter array from an older sender then decodes with those defaults. (msgspec
    still writes trailing defaults of array-like structs; ``omit_defaults`` is for when it won't.)
    """

    prompt_id: int
    prompt_ids: list[int]
    """Token ids of the prompt (shared by every completion)."""
    completion_ids: list[list[int]]
    """Token ids of each completion, without the prompt."""
    behaviour_logprobs: list[list[float]]
    """Per completion token, the sampler's log-probability of that token (same shape as
    ``completion_ids``): the behaviour policy of the off-policy correction."""
    rewards: list[float]
    """One finite reward per completion."""
    version: int
    """Oldest weight version any token was sampled under (see the class docstring)."""
    sampler: str = ""
    """Name of the sampler actor that produced the group (metrics only)."""
    generate_s: float = 0.0
    """Wall seconds the sampler spent generating the group (metrics only)."""
    finished_at: float = 0.0
    """``time.time()`` on the sampler when the group was finished (metrics only)."""
    uid: str = ""
    """Identity given by the driver on receipt, ``sampler/incarnation/sequence``: unique in a run,
    so a test (or a metrics reader) can check that no group is ever trained twice."""
    action_mask: list[list[int]] = []
    """Per completion, 1 for each token the policy sampled and 0 for each token an environment
    wrote (a tool result between two turns: context, with no log-prob and no loss); same shape as
    ``completion_ids``. Empty: every token is the policy's (a single-turn task)."""
    correct: list[bool] = []
    """Per completion, whether it solves its problem (the task's verdict; the train solve rate)."""
    metrics: dict[str, float] = {}
    """Sums over the group's completions of the task's named metrics (``task/<name>``), of failed
    user calls by kind (``task_errors/<kind>``) and of environment counts (``turns``...)."""
    teacher_logprobs: list[list[float]] = []
    """Per completion token, a teacher's log-probability of that token (same shape as
    ``completion_ids``), set by the driver from the scorer for on-policy distillation; empty:
    no teacher."""
    teacher_top_k: int = 0
    """K of ``teacher_topk_ids`` / ``teacher_topk_logprobs`` (``--teacher.top_k``, clamped to the
    teacher's vocabulary); 0: none (the sampled-token form, ``teacher_logprobs``)."""
    teacher_topk_ids: list[list[int]] = []
    """Per completion, the teacher's ``teacher_top_k`` most likely token ids at each of its
    positions (the distribution that predicts that token), flat: position-major, ``len(completion)
    * teacher_top_k`` ids. Empty: none."""
    teacher_topk_logprobs: list[list[float]] = []
    """The teacher's log-probs of ``teacher_topk_ids``, at the samplers' temperature; same layout."""
    version_spans: list[list[VersionSpan]] = []
    """Per completion, the weight versions its tokens were sampled under, as spans in token order:
    the first starts at token 0, starts increase, versions never decrease and none is older than
    ``version``. Empty (or a completion's empty list): every token of it at ``version``."""
    delivered_version: int = -1
    """The weight version its sampler held when the group was done and sent (-1: not said): a
    group finished early in a batch that ran on may be delivered under newer weights than its
    last token's."""

    @property
    def group_size(self) -> int:
        return len(self.completion_ids)

    @property
    def newest_version(self) -> int:
        """The newest version any token of the group was sampled under (``version`` without spans)."""
        return max((spans[-1].version for spans in self.version_spans if spans), default=self.version)

    @property
    def finished_version(self) -> int:
        """The version the group was finished under: when it was delivered, or where that is not
        said, its newest token's. The queue counts staleness from it (driver/queue.py)."""
        return max(self.delivered_version, self.newest_version)

    def token_versions(self, i: int) -> list[int]:
        """The weight version of each token of completion ``i`` (environment tokens included:
        the version of the turn they follow)."""
        n = len(self.completion_ids[i])
        spans = self.version_spans[i] if self.version_spans else []
        if not spans:
            return [self.version] * n
        out: list[int] = []
        for span, nxt in zip(spans, [*spans[1:], None]):
            end = n if nxt is None else nxt.start
            out.extend([span.version] * (end - span.start))
        return out


class TeacherTopK(msgspec.Struct, array_like=True, frozen=True):
    """A scorer's answer for one group with ``--teacher.top_k`` K > 0: ``k`` (K clamped to its
    vocabulary), and per completion the flat ids and log-probs of `RolloutGroup`'s
    ``teacher_topk_ids`` / ``teacher_topk_logprobs``."""

    k: int
    ids: list[list[int]]
    logprobs: list[list[float]]


class InvalidGroupError(AsyncrlError, ValueError):
    """A rollout group's fields do not fit together; ``reason`` says which and how."""

    def __init__(self, prompt_id: int, reason: str):
        super().__init__(f"rollout group for prompt {prompt_id}: {reason}")
        self.prompt_id = prompt_id
        self.reason = reason


def validate_group(group: RolloutGroup) -> None:
    """Raise ``InvalidGroupError`` unless the group's shapes agree and its rewards are finite."""
    n = len(group.completion_ids)
    if n == 0:
        raise InvalidGroupError(group.prompt_id, "has no completions")
    if not group.prompt_ids:
        raise InvalidGroupError(group.prompt_id, "prompt_ids is empty")
    if group.version < 0:
        raise InvalidGroupError(group.prompt_id, f"version {group.version} is negative")
    if len(group.behaviour_logprobs) != n:
        raise InvalidGroupError(
            group.prompt_id, f"{len(group.behaviour_logprobs)} behaviour_logprobs lists for {n} completions"
        )
    if len(group.rewards) != n:
        raise InvalidGroupError(group.prompt_id, f"{len(group.rewards)} rewards for {n} completions")
    for i, (ids, lps) in enumerate(zip(group.completion_ids, group.behaviour_logprobs)):
        if len(ids) != len(lps):
            raise InvalidGroupError(
                group.prompt_id, f"completion {i} has {len(ids)} token ids but {len(lps)} behaviour log-probs"
            )
    if group.action_mask:
        if len(group.action_mask) != n:
            raise InvalidGroupError(group.prompt_id, f"{len(group.action_mask)} action masks for {n} completions")
        for i, (ids, mask) in enumerate(zip(group.completion_ids, group.action_mask)):
            if len(mask) != len(ids):
                raise InvalidGroupError(
                    group.prompt_id, f"completion {i} has {len(ids)} token ids but an action mask of {len(mask)}"
                )
            if any(m not in (0, 1) for m in mask):
                raise InvalidGroupError(
                    group.prompt_id, f"completion {i}'s action mask holds values other than 0 and 1"
                )
    if group.teacher_logprobs:
        if len(group.teacher_logprobs) != n:
            raise InvalidGroupError(
                group.prompt_id, f"{len(group.teacher_logprobs)} teacher_logprobs lists for {n} completions"
            )
        for i, (ids, lps) in enumerate(zip(group.completion_ids, group.teacher_logprobs)):
            if len(ids) != len(lps):
                raise InvalidGroupError(
                    group.prompt_id, f"completion {i} has {len(ids)} token ids but {len(lps)} teacher log-probs"
                )
    if group.teacher_top_k or group.teacher_topk_ids or group.teacher_topk_logprobs:
        _validate_topk(group, n)
    if group.version_spans:
        _validate_spans(group, n)
    if group.delivered_version != -1 and group.delivered_version < group.newest_version:
        raise InvalidGroupError(
            group.prompt_id,
            f"delivered under version {group.delivered_version}, older than its newest token's {group.newest_version}",
        )
    if group.correct and len(group.correct) != n:
        raise InvalidGroupError(group.prompt_id, f"{len(group.correct)} correct flags for {n} completions")
    for i, r in enumerate(group.rewards):
        if not math.isfinite(r):  # NaN/inf would poison the whole group's advantages
            raise InvalidGroupError(group.prompt_id, f"reward {i} is {r!r}, not finite")


def _validate_spans(group: RolloutGroup, n: int) -> None:
    if len(group.version_spans) != n:
        raise InvalidGroupError(group.prompt_id, f"{len(group.version_spans)} version_spans lists for {n} completions")
    for i, (ids, spans) in enumerate(zip(group.completion_ids, group.version_spans)):
        if not spans:
            continue
        if spans[0].start != 0:
            raise InvalidGroupError(
                group.prompt_id, f"completion {i}'s first version span starts at {spans[0].start}, not 0"
            )
        if spans[0].version < group.version:
            raise InvalidGroupError(
                group.prompt_id,
                f"completion {i} has tokens of version {spans[0].version}, older than the group's {group.version}",
            )
        for a, b in zip(spans, spans[1:]):
            if not a.start < b.start < max(len(ids), 1) or b.version < a.version:
                raise InvalidGroupError(
                    group.prompt_id,
                    f"completion {i}'s version spans are out of order ({a.start}:{a.version} then "
                    f"{b.start}:{b.version}, {len(ids)} tokens)",
                )


def _validate_topk(group: RolloutGroup, n: int) -> None:
    k = group.teacher_top_k
    if k < 1:
        raise InvalidGroupError(group.prompt_id, f"teacher top-K data with teacher_top_k {k} (must be >= 1)")
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        values = getattr(group, name)
        if len(values) != n:
            raise InvalidGroupError(group.prompt_id, f"{len(values)} {name} lists for {n} completions")
        for i, (ids, row) in enumerate(zip(group.completion_ids, values)):
            if len(row) != len(ids) * k:
                raise InvalidGroupError(
                    group.prompt_id,
                    f"completion {i} has {len(ids)} token ids but {len(row)} {name} (need {len(ids)} x {k})",
                )
