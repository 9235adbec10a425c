"""`with ddp.no_sync():` in captured code. DDP.no_sync sets `ddp.require_backward_grad_sync` to
False and restores it on leaving; modelled as that attribute store (a side effect, replayed
before the graph break at each DDP call in the block) and the restore at the block's end, to
the value found on entering (read through its source, so guarded). At a break inside the
block, the rest of it runs natively with a real exit that restores that value."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.ddp import ddp_class
from torchweld.capture.sources import AttrSource
from torchweld.capture.values import ConstantValue, ContextManagerValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


def no_sync_method(tx: "Translator", ddp_value: Value) -> Value | None:
    """The value of `ddp.no_sync` where it is DDP's own, else None (inlined as any method)."""
    ddp = ddp_value.real_object()
    if ddp_value.source is None or "no_sync" in ddp.__dict__ or type(ddp).no_sync is not ddp_class().no_sync:
        return None
    tx.output.guards.lacks(AttrSource(ddp_value.source, "__dict__"), "no_sync")  # not shadowed later
    tx.output.guards.identity(AttrSource(AttrSource(ddp_value.source, "__class__"), "no_sync"), type(ddp).no_sync)
    return NoSyncMethodValue(ddp_value)


_FLAG = "require_backward_grad_sync"


class NoSyncMethodValue(Value):
    def __init__(self, ddp_value: Value):
        self.ddp_value = ddp_value

    def call(self, tx, args, kwargs):
        if args or kwargs:
            raise Unsupported("DistributedDataParallel.no_sync() takes no arguments")
        return NoSyncValue(self.ddp_value)


class NoSyncValue(ContextManagerValue):
    def __init__(self, ddp_value: Value):
        self.ddp_value = ddp_value
        self.entered_with: ConstantValue | None = None  # the flag's value found on entering

    def enter(self, tx) -> Value:
        self.entered_with = self.ddp_value.getattr(tx, _FLAG)  # guarded, or stored earlier in the frame
        self.entered_with.as_constant()  # a flag capture cannot know as a constant: a graph break here
        self.ddp_value.setattr(tx, _FLAG, ConstantValue(False))
        return ConstantValue(None)

    def exit_value(self) -> Value:
        return _NoSyncExit(self)  # made before `enter` runs: reads what it found when called


class _NoSyncExit(Value):
    def __init__(self, context: NoSyncValue):
        self.context = context

    def _restore(self) -> object:
        if self.context.entered_with is None:
            raise Unsupported("leaving ddp.no_sync() that was not entered")
        return self.context.entered_with.as_constant()

    def call(self, tx, args, kwargs):
        self.context.ddp_value.setattr(tx, _FLAG, ConstantValue(self._restore()))
        return ConstantValue(None)  # falsy: an exception leaving the block goes on

    def real_object(self) -> object:  # a break inside the block: the rest of it runs natively
        return restoring_sync(self.context.ddp_value.real_object(), self._restore())


def restoring_sync(ddp: torch.nn.Module, value: object) -> Callable:
    """The `__exit__` of `ddp.no_sync()` put back on the stack at a graph break inside it: a
    function, written into the entry's code as a constant (the entry guards the DDP module's
    identity and the value it restores); capture inlines it as the attribute store it is."""

    def leave_no_sync(*exc_info) -> None:
        ddp.require_backward_grad_sync = value

    return leave_no_sync
