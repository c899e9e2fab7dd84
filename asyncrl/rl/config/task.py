"""The Countdown task's section (``--countdown.*``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_SOLVE_NUMBERS = 6
"""Most numbers ``solve`` accepts; its exhaustive search grows factorially with the count."""


@dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """What problems the generator draws. Every problem is solvable by construction."""

    min_count: int = 3
    """Fewest numbers in a problem."""
    max_count: int = 4
    """Most numbers in a problem (at most MAX_SOLVE_NUMBERS)."""
    max_number: int = 99
    """Numbers are drawn uniformly from 1..max_number, repeats allowed."""
    min_target: int = 1
    """Smallest target."""
    max_target: int = 100
    """Largest target."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_count <= self.max_count <= MAX_SOLVE_NUMBERS:
            raise ValueError(f"need 2 <= min_count <= max_count <= {MAX_SOLVE_NUMBERS}, "
                             f"not {self.min_count}..{self.max_count}")
        if not 1 <= self.max_number < 10**6:
            raise ValueError(f"max_number must be in 1..999999, not {self.max_number}")
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError(f"need 1 <= min_target <= max_target, not {self.min_target}..{self.max_target}")
