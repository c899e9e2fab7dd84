"""The trainer's held-out evaluation: the solve rate of the policy it holds on the task's held-out
split, greedy and sampled, with the task's metrics and its failed calls.

The problems, the task and its calls' budget are a `HeldoutSet`'s (``rl/model/heldout.py``, which
the samplers' evaluation shares); here they are solved with ``model.generate`` (`hf_generate_for`),
in parts of whole batches, so the trainer can say how far it has got (`progress`) while the
driver waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.model.heldout import HeldoutSet
from asyncrl.rl.model.tally import HeldoutAsk, HeldoutPart
from asyncrl.rl.tasks.loading import TaskSpec
from asyncrl.rl.trainer.compile import eager

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from asyncrl.rl.model.policy import PromptFormat


class HeldoutEvaluation:
    """The held-out problems of ``task`` (``data.n_heldout`` of them, from ``data.data_seed``),
    solved by a policy when called. Its owner calls `close` when it stops."""

    def __init__(self, task: TaskSpec, data: DataConfig):
        self.heldout = HeldoutSet(task, data)
        self.progress = [0, 0]
        """Problems done by the evaluation under way (or the last): greedy, sampled. Written by
        the evaluation's thread, read by the actor's `heldout_progress` endpoint."""

    @property
    def _heldout(self) -> list:
        return self.heldout.problems

    def __call__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        fmt: PromptFormat,
        ask: HeldoutAsk,
        *,
        temperature: float,
        compiled: bool,
        version: int = 0,
    ) -> list[HeldoutPart]:
        """The held-out problems ``ask`` names (`HeldoutAsk`), sampled at ``temperature``, tagged
        ``version`` (`HeldoutSet.solve`; `heldout_answer` makes the rates of them). ``compiled``:
        the policy's layers are compiled, and run eagerly while generating (a KV cache:
        ``trainer/compile.py``). The model is left in train mode. Blocking: the trainer runs it on
        a thread."""
        from asyncrl.rl.model.evaluation import hf_generate_for

        every = range(len(self.heldout.problems))
        samples, rows = ask.samples, ask.rows
        greedy: Sequence[int] = every if ask.greedy is None else ask.greedy
        sampled: Sequence[int] = (every if samples else []) if ask.sampled is None else ask.sampled
        self.progress = [0, 0]

        def told(part: HeldoutPart) -> None:
            self.progress[part.sampled] += len(part.problems)

        model.eval()
        try:
            with eager(compiled):
                return asyncio.run(
                    self.heldout.solve(
                        hf_generate_for(self.heldout.task, model, tokenizer, fmt, rows),
                        fmt,
                        greedy=greedy,
                        sampled=sampled,
                        samples=samples,
                        max_new_tokens=ask.max_new_tokens or fmt.max_new_tokens_hint,
                        temperature=temperature,
                        max_context=getattr(model.config, "max_position_embeddings", 0) or 0,
                        rows=rows,
                        versions=lambda: [version],
                        on_part=told,
                    )
                )
        finally:
            model.train()

    def close(self) -> None:
        """End the threads the task's calls run on (started by the first evaluation); the owner
        calls it when it stops. Idempotent; an evaluation after it raises `TaskFailureError`."""
        self.heldout.close()
