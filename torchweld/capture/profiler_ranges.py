"""`with torch.autograd.profiler.record_function(name):` in captured code: a no-op context.
The graph's operations are not recorded inside the user's named profiler range (as under
torch.compile); everything else about the block is captured. Outside a compiled function,
and in code that runs at a graph break, the range is recorded as usual."""
from __future__ import annotations

import torch

from torchweld.capture.values import ConstantValue, ContextManagerValue, Value


class ProfilerRangeValue(ContextManagerValue):
    def enter(self, tx) -> Value:
        return ConstantValue(None)

    def exit_value(self) -> Value:
        return _RangeExit()


class _RangeExit(Value):
    def call(self, tx, args, kwargs):
        return ConstantValue(None)  # falsy: an exception leaving the block goes on

    def real_object(self) -> object:  # a break inside the block: the rest of it, rangeless
        return leave_range


def leave_range(*exc_info) -> None:
    """The `__exit__` of a no-op range, put back on the stack at a graph break inside one."""
    return None


def profiler_range_call(fn: object) -> Value | None:
    """The value of calling `fn` if it is torch's record_function, else None."""
    if fn is torch.autograd.profiler.record_function:
        return ProfilerRangeValue()
    return None
