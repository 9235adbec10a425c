"""Where the program generator's choices come from: hypothesis (pytest, shrinkable) or
a seeded random.Random (the big run, one reproducible stream per program)."""
from __future__ import annotations

import random
from typing import Sequence, TypeVar

T = TypeVar("T")


class Draw:
    """The choices a generator makes. Options are listed simplest first: hypothesis
    shrinks towards the first option, the lowest integer and False."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, options: Sequence[T]) -> T:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        """True with probability p (shrinks to False)."""
        return self.integer(0, 999) >= round(1000 * (1 - p))

    def weighted(self, options: Sequence[T], weights: Sequence[int]) -> T:
        pick = self.integer(0, sum(weights) - 1)
        for option, weight in zip(options, weights):
            if pick < weight:
                return option
            pick -= weight
        raise AssertionError("unreachable")


class RandomDraw(Draw):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class HypothesisDraw(Draw):
    """Draws through `st.data()`, so hypothesis records, replays and shrinks the choices."""

    def __init__(self, data):
        from hypothesis import strategies as st

        self.data = data
        self.st = st

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))
