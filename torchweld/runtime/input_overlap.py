"""Whether a tensor a compiled graph writes in place shares memory with one of its inputs on
this call: then the graph runs as it was captured, op by op, instead of weld's kernels.

weld's lowering gives every input memory of its own: an in-place write into input `y` is a
new value of `y` alone, written back after the kernels, and the kernels read input `x` as it
was. Where the caller passed `x` and `y = x.detach()` (or `x[1]`), eager's later reads of
`x` see the write. The check (AOTAutograd's) costs a storage look-up per tensor input and per
written tensor, and is made only for graphs that write tensors in place; others never meet it.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

log = logging.getLogger("torchweld.weld")


class WrittenOverlap:
    """Over one list of a graph's tensors (its inputs, then what else it reads: module state,
    constants): `written`, the positions of those it writes in place; `inputs`, the positions of
    the inputs (the caller's tensors, which may share memory in any way). Module state and
    constants are not compared with one another: they are the module's, guarded by identity."""

    def __init__(self, written: Sequence[int], inputs: Sequence[int]):
        self.written, self.inputs = tuple(written), tuple(inputs)
        self.found_once = False

    def found(self, tensors: Sequence) -> bool:
        """Whether a written tensor shares memory with an input other than itself."""
        by_storage: dict[int, list[int]] = {}
        for i in self.inputs:
            t = tensors[i]
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                by_storage.setdefault(t.untyped_storage()._cdata, []).append(i)
        for i in self.written:
            w = tensors[i]
            for j in by_storage.get(w.untyped_storage()._cdata, ()):
                if j != i and _meet(w, tensors[j]):
                    if not self.found_once:
                        self.found_once = True
                        log.info("a tensor this graph writes in place shares memory with another of its "
                                 "inputs: such calls run the graph op by op, as captured")
                    return True
        return False


class OverlapChecked:
    """`compiled(*args)`, or `exact(*args)` where `overlap` finds a written tensor sharing memory
    with an input; `constants`: the tensors after the inputs that `overlap`'s positions count."""

    def __init__(self, compiled: Callable, exact: Callable, overlap: WrittenOverlap, constants: Sequence = ()):
        self.compiled, self.exact, self.overlap = compiled, exact, overlap
        self.constants = tuple(constants)

    def __call__(self, *args):
        if self.overlap.found(args + self.constants if self.constants else args):
            return self.exact(*args)
        return self.compiled(*args)


def _meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the spans of memory two tensors of one storage reach meet (x[0] and x[1] do not)."""
    lo_a, hi_a = _span(a)
    lo_b, hi_b = _span(b)
    return lo_a < hi_b and lo_b < hi_a


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of `t`'s elements in its storage; empty for no elements."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
    return start + low * size, start + (high + 1) * size
