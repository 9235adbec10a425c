"""How a C++ reduction kernel walks its reduced loops: in chunks, whose float partial sums
a double total adds up, and, for a long row with few outputs, across threads.

One float accumulator per SIMD lane over a whole row loses about one ulp of the total per
element it adds: `(x * 1.0).mean()` of 10**8 elements of 0.1 gave 0.112. Summed in chunks
of tuning.chunk elements (tuning.chunk / lanes per lane: 16 with AVX-512, 32 with AVX2) and
the chunks in double, the error is that of a 32-element float sum at most; eager's cascade
sum is within the same factor. (1024-element chunks, 128 adds a lane with AVX2, were 12 times
less accurate than eager on a constant row, whose roundings all go one way; 256 costs no time.)

A row of tuning.threaded_min elements or more, with at most tuning.threaded_max_outputs of
them, is cut into tuning.segments fixed segments of chunks that the threads share; each
segment's results are combined in segment order afterwards, so the answer does not depend
on the thread count (OpenMP's own reduction clause combines in the order threads finish).
"""
from __future__ import annotations

import dataclasses
import math

from torchweld.compiler.symbols import hint, is_symbol_size, known
from torchweld.tuning import tuning


@dataclasses.dataclass(frozen=True)
class ReducedLoops:
    """The reduced loops of a kernel (those of more than one iteration, outermost first), the
    one cut into chunks, and whether threads share the row."""

    loops: tuple[tuple[str, int], ...]  # (variable, size)
    split: int | None  # position in `loops` of the loop cut into chunks; None: the row is one chunk
    chunk: int  # iterations of that loop a chunk takes
    threaded: bool

    @property
    def chunked(self) -> bool:
        return self.split is not None

    @property
    def chunks_per_pass(self) -> int:
        """Chunks in one pass of the split loop."""
        return -(-self.loops[self.split][1] // self.chunk)

    @property
    def chunks(self) -> int:
        return math.prod(size for _, size in self.loops[:self.split]) * self.chunks_per_pass


def reduced_loops(outer: tuple[int, ...], reduced: tuple[int, ...], lanes: int = 1) -> ReducedLoops:
    """The walk for a kernel with outer loop sizes `outer` and reduced loop sizes `reduced`:
    the split loop is the outermost one whose loops under it take at most tuning.chunk
    elements; a chunk is as many of its iterations as fit in tuning.chunk elements (at least
    one). `lanes`: the outputs each step of the reduced loops adds to at once, a lane each (an
    outer reduction's block of columns): its chunks take tuning.chunk / lanes steps, as many
    adds a lane as a row's chunk gives each SIMD lane.

    A symbolic size (backends/weld_symbolic.py) counts as more than tuning.chunk unless its
    range proves otherwise: the chunked walk serves every length, with no guard; whether
    threads share the row is chosen at the compiled call's sizes (either is right)."""
    loops = tuple((f"r{k}", size) for k, size in enumerate(reduced) if size != 1)
    row, most = math.prod(size for _, size in loops), max(1, tuning.chunk // lanes)
    if _at_most(row, most):
        return ReducedLoops(loops, None, 0, False)
    split, inner = len(loops) - 1, 1
    while split > 0 and _at_most(inner * loops[split][1], most):
        inner *= loops[split][1]
        split -= 1
    threaded = hint(row) * lanes >= tuning.threaded_min and hint(math.prod(outer)) <= tuning.threaded_max_outputs
    return ReducedLoops(loops, split, _chunk(loops[split][1], max(1, most // inner)), threaded)


def _at_most(n: object, most: int) -> bool:
    """`n <= most`; for a symbolic `n`, where its range proves it."""
    return known(n <= most) is True if is_symbol_size(n) else n <= most


def _chunk(size: int, most: int) -> int:
    """Iterations per chunk of a loop of `size`: at most `most`, and a divisor of `size` not
    below half of it where there is one, so that every chunk loop runs a fixed count (a
    symbolic size: `most`, its last chunk shorter)."""
    if is_symbol_size(size):
        return most
    for chunk in range(most, most // 2, -1):
        if size % chunk == 0:
            return chunk
    return most
