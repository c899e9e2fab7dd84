"""`UniformGroups`: the groups left out of training because they carry no learning signal.

A group whose completions all scored the same has every advantage zero (mean-centred, or divided
by a zero std), so its clipped-surrogate gradient is exactly zero: training on it costs a share of
the step and moves nothing but a KL term. Leaving such groups out and letting the samplers make
others in their place is DAPO's "dynamic sampling" (Yu et al., 2025); on the embedded Countdown
model a large share of the groups are uniform (benchmarks/README.md, "Figures that were in the
code"), and a batch of the same size then holds only groups with a signal.

A task may give no signal at all for a while (a fresh model that solves nothing), so at most
``per_batch`` groups are left out between two batches taken: past that, uniform groups are
trained as before, and the run never waits on a signal that does not come.
"""

from __future__ import annotations

from asyncrl.rl.rollout import RolloutGroup


def is_uniform(group: RolloutGroup) -> bool:
    """Every completion of ``group`` has the same reward."""
    return len(set(group.rewards)) <= 1


class UniformGroups:
    """Which delivered groups go to the queue (see the module docstring). ``per_batch`` 0: all."""

    def __init__(self, per_batch: int):
        self.per_batch = per_batch
        self.left = per_batch  # what may still be left out before the next batch is taken
        self.total = 0
        self._since: list[RolloutGroup] = []

    def leave_out(self, group: RolloutGroup) -> bool:
        """True (and counted) when ``group`` is uniform and the budget allows leaving it out."""
        if self.left <= 0 or not is_uniform(group):
            return False
        self.left -= 1
        self.total += 1
        self._since.append(group)
        return True

    def batch_taken(self) -> None:
        self.left = self.per_batch

    def take(self) -> list[RolloutGroup]:
        """The groups left out since the last call (their rewards still count in the step's rates)."""
        taken, self._since = self._since, []
        return taken
