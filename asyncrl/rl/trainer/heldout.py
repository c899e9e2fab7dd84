"""The trainer's held-out evaluation: the solve rate of the policy it holds on the task's held-out
split, greedy and sampled, with the task's metrics and its failed calls.

The task never crosses a process boundary: it is built here from its spec, on the first
evaluation, and its splits are deterministic, so these are the held-out problems the driver
checked before spawning anything. The task's calls run under one budget for the whole run
(`UserCalls`), as the samplers' do.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.tasks.loading import TaskSpec
from asyncrl.rl.trainer.compile import eager


class HeldoutEvaluation:
    """The held-out problems of ``task`` (``data.n_heldout`` of them, from ``data.data_seed``),
    solved by a policy when called. Its owner calls `close` when it stops."""

    def __init__(self, task: TaskSpec, data: DataConfig):
        self.task_spec, self.data = task, data
        self._task = None  # built on the first evaluation
        self._calls = None  # its score/step calls: one budget for every evaluation of the run

    def __call__(
        self,
        model: Any,
        tokenizer: Any,
        fmt: Any,
        *,
        samples: int,
        max_new_tokens: int,
        batch_size: int,
        temperature: float,
        compiled: bool,
    ) -> dict[str, float | dict[str, int]]:
        """``greedy`` and, with ``samples`` completions per problem at ``temperature``, ``sampled``
        solve rates; the task's metrics of the greedy episodes as ``task/<name>``; failed calls of
        both as ``task_errors/<kind>``; an agent's failed episodes by what they were as
        ``failures`` (``greedy: raised TYPE: first line`` or ``sampled: ...`` -> how many, one
        line per kind: `Evaluation.failures`; absent when none failed). ``compiled``: the
        policy's layers are compiled, and run eagerly while generating (a KV cache:
        ``trainer/compile.py``). The model is left in train mode."""
        from asyncrl.rl.model.evaluation import evaluate
        from asyncrl.rl.tasks.loading import load_task
        from asyncrl.rl.tasks.scoring import UserCalls

        if self._task is None:  # the held-out split alone: it does not depend on n_train
            self._task = load_task(self.task_spec)
            self._heldout = list(self._task.splits(self.data.data_seed, 1, self.data.n_heldout).heldout)
            self._calls = UserCalls(
                self._task.task_name(),
                self.task_spec.score_timeout_s,
                self.task_spec.max_failure_rate,
                stop_early=True,
            )
        common = dict(
            task=self._task,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            calls=self._calls,
            max_context=getattr(model.config, "max_position_embeddings", 0) or 0,
        )
        model.eval()
        try:
            with eager(compiled):
                greedy = evaluate(model, tokenizer, fmt, self._heldout, greedy=True, **common)
                out = {"greedy": greedy.solve_rate, **{f"task/{k}": v for k, v in greedy.metrics.items()}}
                errors = dict(greedy.errors)
                failures = {f"greedy: {k}": v for k, v in greedy.failures.items()}
                if samples:
                    sampled = evaluate(
                        model, tokenizer, fmt, self._heldout, greedy=False, n=samples, temperature=temperature, **common
                    )
                    out["sampled"] = sampled.solve_rate
                    errors = {k: errors.get(k, 0) + sampled.errors.get(k, 0) for k in {*errors, *sampled.errors}}
                    failures |= {f"sampled: {k}": v for k, v in sampled.failures.items()}
            out |= {f"task_errors/{k}": float(v) for k, v in sorted(errors.items())}
            return out | ({"failures": failures} if failures else {})
        finally:
            model.train()

    def close(self) -> None:
        """End the threads the task's calls run on (started by the first evaluation); the owner
        calls it when it stops. Idempotent; an evaluation after it raises `TaskFailureError`."""
        if self._calls is not None:
            self._calls.close()
