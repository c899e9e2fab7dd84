"""A sampler's walk over the train split: shuffled epochs, counted so a resume can skip ahead."""

from __future__ import annotations

import random
from collections.abc import Iterator


def shuffled_walk(n: int, seed: int) -> Iterator[int]:
    """Indices 0..n-1 in a fresh shuffled order per epoch, forever; the same for the same seed."""
    rng = random.Random(f"sampler/{seed}")
    order = list(range(n))
    while True:
        rng.shuffle(order)
        yield from order


class CountedWalk:
    """A sampler's walk over the train split that counts the prompts it handed out, so that a
    resumed run continues the walk where the checkpoint left it (``drawn`` skipped at start).
    ``seed`` is the walk's, saved with ``drawn`` (-1: a walk not made by `shuffled_walk`)."""

    def __init__(self, walk: Iterator[int], drawn: int = 0, seed: int = -1):
        self._walk = walk
        for _ in range(drawn):
            next(self._walk)
        self.drawn = drawn
        self.seed = seed

    def __iter__(self) -> CountedWalk:
        return self

    def __next__(self) -> int:
        index = next(self._walk)
        self.drawn += 1
        return index
