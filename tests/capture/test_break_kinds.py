"""Graph-break reasons grouped by kind (capture/break_kinds.py) in explain()."""
from __future__ import annotations

import pytest
import torch

import torchweld
from torchweld.capture.break_kinds import BreakKind, kind_of


@pytest.mark.parametrize("reason,kind", [
    ("data-dependent control flow: branching on a tensor's value", BreakKind.DATA_DEPENDENT),
    ("data-dependent: Tensor.item() reads a tensor's value out of the graph", BreakKind.DATA_DEPENDENT),
    ("formatting a tensor into a string needs its values", BreakKind.DATA_DEPENDENT),
    ("sum() over a tensor's values needs them; use tensor.sum()", BreakKind.DATA_DEPENDENT),
    ("print() needs Python", BreakKind.PYTHON),
    ("checkpoint is marked by torch to run without compilers", BreakKind.PYTHON),
    ("generators are not captured; the generator runs eagerly", BreakKind.PYTHON),
    ("raises KeyError (the eager run raises it, and no captured handler catches it)", BreakKind.USER_ERROR),
    ("torch.cat() raised RuntimeError: Sizes of tensors must match", BreakKind.USER_ERROR),
    ("local variable 'y' referenced before assignment", BreakKind.USER_ERROR),
    ("setting attribute 'x' of Foo() is a side effect capture does not model yet", BreakKind.SIDE_EFFECT),
    ("deleting attribute 'w' of Foo(), an object from outside the frame", BreakKind.SIDE_EFFECT),
    ("deque has no attribute 'rotate' capture models", BreakKind.UNMODELLED),
    ("unsupported opcode BEFORE_ASYNC_WITH", BreakKind.UNMODELLED),
    ("DistributedDataParallel runs its bookkeeping for the backward in Python: ...", BreakKind.DISTRIBUTED),
    ("backend 'weld' failed", BreakKind.BACKEND),
    ("internal error in torchweld: KeyError: 3", BreakKind.INTERNAL),
])
def test_each_reason_has_its_kind(reason, kind):
    assert kind_of(reason) is kind


def test_explain_counts_breaks_by_kind():
    def fn(x):
        x = x + 1
        print("", end="")
        if x.sum() > 0:
            x = x * 2
        return x.tolist(), x

    report = torchweld.explain(fn)(torch.ones(3))
    assert report.breaks_by_kind == {BreakKind.DATA_DEPENDENT: 2, BreakKind.PYTHON: 1}
    assert [r.kind for r in report.break_reasons] == [BreakKind.PYTHON, BreakKind.DATA_DEPENDENT,
                                                      BreakKind.DATA_DEPENDENT]
    text = str(report)
    assert "[python]" in text and "data_dependent: 2" in text
