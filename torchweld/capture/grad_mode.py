"""`torch.no_grad()`, `torch.enable_grad()`, `torch.set_grad_enabled(b)` and
`torch.is_grad_enabled()` inside a captured frame: the graph records each mode
change as a `torch._C._set_grad_enabled` node, and fake tensors follow it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchweld.capture.values import ConstantValue, ContextManagerValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


class GradModeContextValue(ContextManagerValue):
    """A grad-mode context manager; `with` enters it (BEFORE_WITH)."""

    def __init__(self, enabled: bool, previous: bool | None = None):
        self.enabled = enabled
        self.previous = previous  # set when the mode already changed at construction

    def enter(self, tx: "Translator") -> Value:
        if self.previous is None:
            self.previous = tx.output.grad_enabled
            tx.output.set_grad_enabled(self.enabled)
        return ConstantValue(None)

    def exit_value(self) -> Value:
        return GradModeExitValue(self)


class GradModeExitValue(Value):
    """The bound `__exit__` that BEFORE_WITH leaves on the stack."""

    def __init__(self, context: GradModeContextValue):
        self.context = context

    def call(self, tx, args, kwargs):
        tx.output.set_grad_enabled(self.context.previous)
        return ConstantValue(None)


def entered_again(enabled: bool, previous: bool) -> torch.set_grad_enabled:
    """A grad-mode context made again at a graph break, whose `__exit__` restores `previous`
    (the mode outside the `with`, whatever the mode is when the context is remade)."""
    torch._C._set_grad_enabled(previous)
    return torch.set_grad_enabled(enabled)


def grad_mode_call(tx: "Translator", fn: object, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
    """The value of calling `fn` if it is a grad-mode function or class, else None."""
    if fn is torch.no_grad:
        return GradModeContextValue(False)
    if fn is torch.enable_grad:
        return GradModeContextValue(True)
    if fn is torch.set_grad_enabled:
        enabled = bool((args[0] if args else kwargs["mode"]).as_constant())
        previous = tx.output.grad_enabled
        tx.output.set_grad_enabled(enabled)
        return GradModeContextValue(enabled, previous)
    if fn is torch._C._set_grad_enabled:  # what the __exit__ of a grad-mode context calls
        tx.output.set_grad_enabled(bool(args[0].as_constant()))
        return ConstantValue(None)
    if fn is torch.is_grad_enabled:
        return ConstantValue(tx.output.grad_enabled)
    if fn is torch.inference_mode:
        raise Unsupported("torch.inference_mode inside a compiled function is not captured yet")
    return None
