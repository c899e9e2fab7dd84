"""The GRPO driver: the process that runs ``train()``. It spawns the trainer and the samplers,
pumps rollouts into the queue, steps, syncs weights, handles sampler faults, and writes the run
directory. Torch-free: the actors import torch in their own processes."""

from asyncrl.rl.driver.faults import RunStoppedError
from asyncrl.rl.driver.preflight import check_run, resumed_config
from asyncrl.rl.driver.run import train

__all__ = ["RunStoppedError", "check_run", "resumed_config", "train"]
