"""Metric writers: each step's record of metrics.jsonl, also as TensorBoard scalars and W&B logs.

metrics.jsonl stays the record of a run (a resume truncates it; curves.png, ``asyncrl status``
and ``asyncrl plot`` read it). `MetricWriters` fans the same record out to the optional viewers
behind one interface, `MetricWriter`: TensorBoard through torch's own ``SummaryWriter`` (on by
default when the tensorboard package is importable), and Weights & Biases (``--run.wandb
PROJECT``; wandb's own variables, WANDB_MODE=offline included, apply). A viewer that fails is
dropped with one line; it never stops the run.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Protocol

from asyncrl.rl.observe.record import StepRecord

WANDB_ID_FILE = "wandb.id"
"""The W&B run id, kept in the run directory so that a resumed run logs to the same W&B run."""


class MetricWriter(Protocol):
    """A viewer of a run's metrics: `write` one step's scalars, `close` once at the end."""

    name: str

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Event files in the run directory (``tensorboard --logdir runs`` shows every run by name)."""

    name = "TensorBoard"

    def __init__(self, run_dir: str, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides what the previous segment wrote past its checkpoint,
        # as metrics.jsonl is truncated there.
        self.writer = SummaryWriter(log_dir=run_dir, purge_step=first_step if first_step > 1 else None, flush_secs=20)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """One W&B run per run directory (its id kept in RUN_DIR/wandb.id, so a resume continues it)."""

    name = "Weights & Biases"

    def __init__(self, project: str, run_dir: str, config: dict[str, Any]):
        import wandb

        id_path = os.path.join(run_dir, WANDB_ID_FILE)
        try:
            with open(id_path) as f:
                run_id = f.read().strip()
        except FileNotFoundError:
            run_id = secrets.token_hex(8)
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            dir=run_dir,
            name=os.path.basename(run_dir.rstrip(os.sep)),
            config=config,
        )

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricWriters:
    """The run's viewers, fed the records written to metrics.jsonl."""

    def __init__(self, writers: list[MetricWriter], log=print):
        self.writers, self.log = writers, log

    @classmethod
    def open(cls, run_dir: str, observe: Any, config: dict[str, Any], *, first_step: int, log=print) -> MetricWriters:
        """The viewers ``observe`` (the run's `ObserveConfig`) asks for and this Python has; each
        opened one is named in one line, as is a default one that is not installed."""
        writers: list[MetricWriter] = []
        if observe.tensorboard:
            try:
                import tensorboard  # noqa: F401  (SummaryWriter needs it; torch does not depend on it)
            except ImportError:
                log("TensorBoard: the tensorboard package is not installed (pip install tensorboard); no event files")
            else:
                writers.append(TensorBoardWriter(run_dir, first_step))
                log(f"TensorBoard: event files in {run_dir} (tensorboard --logdir {os.path.dirname(run_dir)})")
        if observe.wandb:  # preflight refused a run that asks for it without wandb installed
            try:
                writers.append(WandbWriter(observe.wandb, run_dir, config))
                log(f"Weights & Biases: project {observe.wandb}, run {os.path.basename(run_dir)}")
            except Exception as exc:  # its service, its login: the run goes on without it, said once
                log(
                    f"Weights & Biases: could not start a run in project {observe.wandb}: "
                    f"{type(exc).__name__}: {exc}; going on without it"
                )
        return cls(writers, log)

    @property
    def tensorboard(self) -> bool:
        """TensorBoard event files are being written."""
        return any(isinstance(w, TensorBoardWriter) for w in self.writers)

    def write(self, record: StepRecord) -> None:
        scalars = record.scalars()
        for writer in list(self.writers):
            try:
                writer.write(record.step, scalars)
            except Exception as exc:  # a viewer's failure (a full disk, its service) is not the run's
                self.writers.remove(writer)
                self.log(f"{writer.name}: stopped writing after an error: {type(exc).__name__}: {exc}")
                _close_quietly(writer)

    def close(self) -> None:
        for writer in self.writers:
            _close_quietly(writer)
        self.writers = []


def _close_quietly(writer: MetricWriter) -> None:
    try:
        writer.close()
    except Exception:  # closing after a failure, or at a stop: the first error was said
        pass
