"""`with torch.autocast(...)` inside a captured frame (also `torch.amp.autocast`, the
deprecated `torch.cuda.amp.autocast`/`torch.cpu.amp.autocast`, and an autocast object
made outside, as the `@torch.autocast(...)` decorator holds one).

The region becomes two graph nodes, `torch.amp._enter_autocast(device, dtype, enabled,
cache_enabled)` and `torch.amp._exit_autocast(<that node>)`, as torch.compile records
it. Fake runs of the operations between them happen under that autocast state, so their
example values carry its dtypes; a backend that runs the graph (eager, cudagraphs)
enters and leaves autocast at those nodes, and one that traces it (weld) records the
casts autocast makes there. A graph that stops at a break inside a region leaves it
at its end, and the code after the graph enters it again (reconstruct.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchweld.capture.values import ConstantValue, ContextManagerValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

# torch.autocast is torch.amp.autocast; the cuda and cpu spellings are subclasses
AUTOCAST_CLASSES = (torch.amp.autocast, torch.cuda.amp.autocast, torch.cpu.amp.autocast)
# An autocast object's own methods change the process's autocast state: opaque to capture
# (builder.wrap), so a call to one is a break and runs natively
AUTOCAST_METHODS = frozenset({torch.amp.autocast.__enter__.__code__, torch.amp.autocast.__exit__.__code__})


def autocast_args(context: torch.amp.autocast) -> tuple:
    """(device, dtype, enabled, cache_enabled): what `_enter_autocast` takes, from an autocast
    object (whose constructor settled the defaults and checked the dtype)."""
    return context.device, context.fast_dtype, context._enabled, context._cache_enabled


class AutocastContextValue(ContextManagerValue):
    """An autocast context manager with its arguments known at capture time."""

    def __init__(self, args: tuple):
        self.args = args

    def enter(self, tx: "Translator") -> Value:
        tx.output.enter_autocast(self.args)
        return self  # `with torch.autocast(...) as ctx`: ctx is the autocast object

    def exit_value(self) -> Value:
        return AutocastExitValue(self)

    def __repr__(self) -> str:
        return f"AutocastContextValue{self.args}"


class AutocastExitValue(Value):
    """The bound `__exit__` that BEFORE_WITH leaves on the stack."""

    def __init__(self, context: AutocastContextValue):
        self.context = context

    def call(self, tx, args, kwargs):
        tx.output.exit_autocast()
        return ConstantValue(None)


def autocast_call(tx: "Translator", fn: object, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
    """The value of calling `fn` if it is an autocast class, else None."""
    if not (isinstance(fn, type) and issubclass(fn, torch.amp.autocast)):
        return None
    if fn not in AUTOCAST_CLASSES:
        raise Unsupported(f"{fn.__qualname__}, a subclass of torch.autocast, is not captured")
    try:
        constants = [a.as_constant() for a in args], {k: v.as_constant() for k, v in kwargs.items()}
    except Unsupported:
        raise Unsupported("torch.autocast(...) with an argument not known at capture time") from None
    context = fn(*constants[0], **constants[1])  # checks the arguments (and warns) as eager does
    return AutocastContextValue(autocast_args(context))


def context_of_object(obj: object) -> AutocastContextValue | None:
    """An autocast object made outside the frame, entered by `with` inside it."""
    if type(obj) in AUTOCAST_CLASSES:
        return AutocastContextValue(autocast_args(obj))
    return None
