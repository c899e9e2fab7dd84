"""What a run shows of itself besides metrics.jsonl (flat in ``--run.*``): TensorBoard, Weights &
Biases, the curves picture, the progress bar, and the HTTP endpoint for Prometheus and probes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    """Views of a run. metrics.jsonl stays the record; each of these is drawn from its records."""

    tensorboard: bool = True
    """TensorBoard event files in the run directory, one scalar per metric of metrics.jsonl, when
    the tensorboard package is installed (else one line says so); false: none."""
    wandb: str = ""
    """Weights & Biases project to log every metric to (needs the wandb package; WANDB_MODE=offline
    and wandb's other variables apply as usual); empty: off."""
    curves: bool = True
    """RUN_DIR/curves.png, redrawn at every evaluation and at the end (needs matplotlib, else one
    line says so); false: none."""
    progress_bar: bool = True
    """A progress bar when stdout is a terminal; plain lines otherwise, or with false."""
    metrics_port: int = 0
    """Serve Prometheus /metrics and a deep /healthz (every actor probed) on this port of
    ``metrics_host`` (needs prometheus-client); 0: off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds to (0.0.0.0: every interface, for a scraper elsewhere)."""
    health_timeout_s: float = 2.0
    """How long /healthz waits for each actor's answer before it names the actor silent."""
    stall_factor: float = 10.0
    """A step that runs longer than this many times the median of the recent steps (and than
    ``stall_floor_s``) is a stall: one line says what it waits for, `asyncrl status` shows
    ``stalled`` and /healthz answers 503 until a step ends (rl/observe/stall.py); 0: off."""
    stall_floor_s: float = 120.0
    """The least a step may take before it counts as a stall, however fast the recent steps were."""
    episodes: int = 1
    """Trained episodes RUN_DIR/episodes.jsonl keeps a step (the first completions of the step's
    groups, in the order trained), for ``asyncrl show RUN_DIR --step N --episode K``; 0: none."""
    episode_ids: bool = False
    """Keep each recorded episode's prompt and completion token ids, action mask and sampling
    log-probs too (``asyncrl show --ids``), for debugging token-exactness; a few times the size."""
    loop_watch_s: float = 5.0
    """When the driver's event loop runs nothing for this long (a synchronous call blocks it, and
    with it every deadline, heartbeat and `asyncrl status`), one line names the call it is stuck in,
    and one more says when it ran again (runtime/loop_watch.py); 0: off."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (0: off), not {self.metrics_port!r}")
        if not self.health_timeout_s > 0:
            raise ValueError(f"health_timeout_s must be > 0, not {self.health_timeout_s!r}")
        if not (0 <= self.stall_factor < float("inf")) or not (0 <= self.stall_floor_s < float("inf")):
            raise ValueError(
                f"stall_factor and stall_floor_s must be finite numbers >= 0 (stall_factor 0: off), "
                f"not {self.stall_factor!r} and {self.stall_floor_s!r}"
            )
        if not 0 <= self.loop_watch_s < float("inf"):
            raise ValueError(
                f"loop_watch_s must be a finite number of seconds >= 0 (0: off), not {self.loop_watch_s!r}"
            )
        if isinstance(self.episodes, bool) or not isinstance(self.episodes, int) or self.episodes < 0:
            raise ValueError(f"episodes must be a whole number >= 0 (0: none), not {self.episodes!r}")
        if not self.metrics_host:
            raise ValueError("metrics_host must be an address to bind to, e.g. 127.0.0.1")
