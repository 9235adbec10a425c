"""`with` on an object whose class defines `__enter__` and `__exit__` in Python (your own
context managers, `contextlib.nullcontext`): both are inlined, so the block is captured.

BEFORE_WITH inlines `__enter__` and leaves the bound `__exit__` on the stack; the block's
end calls it with three Nones, which inlines it too. Side effects of either (attribute
stores, globals) are replayed after the graph, as everywhere in capture, so a graph that
raises leaves none of them behind. A break inside the block rebuilds the object and puts
its real `__exit__` back on the stack, where an exception in the rest of the block reaches
it natively."""
from __future__ import annotations

import inspect
import types
from typing import TYPE_CHECKING

from torchweld.capture.values import ContextManagerValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


class PythonContextValue(ContextManagerValue):
    def __init__(self, manager: Value, exit_method: Value):
        self.manager = manager
        self.exit = PythonContextExitValue(manager, exit_method)

    def enter(self, tx: "Translator") -> Value:
        return self.manager.getattr(tx, "__enter__").call(tx, [], {})

    def exit_value(self) -> Value:
        return self.exit


class PythonContextExitValue(Value):
    """The bound `__exit__` that BEFORE_WITH leaves on the stack (rebuilt as `manager.__exit__`)."""

    def __init__(self, manager: Value, exit_method: Value):
        self.manager = manager
        self.exit_method = exit_method

    def call(self, tx, args, kwargs):
        return self.exit_method.call(tx, args, kwargs)


def python_context_of(tx: "Translator", value: Value) -> PythonContextValue | None:
    """`value` as a context manager to inline, where its class (guarded where the object came
    from outside) defines both methods as Python functions; else None."""
    try:
        cls = value.python_type()
    except Unsupported:
        return None
    methods = [inspect.getattr_static(cls, name, None) for name in ("__enter__", "__exit__")]
    if not all(isinstance(m, types.FunctionType) for m in methods):
        return None
    return PythonContextValue(value, value.getattr(tx, "__exit__"))
