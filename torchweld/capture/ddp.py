"""DistributedDataParallel's forward with its module captured: DDP's bookkeeping (the
reducer's preparation for the backward, buffer syncs, `no_sync()`, the DDPSink of
`find_unused_parameters` and `static_graph`) runs in Python on every call, as eager DDP
runs it, around a compiled call of the wrapped module. Used by `torchweld.compile(ddp)` and
at the graph break where captured code calls a DDP module (`with ddp.no_sync():` in captured
code: capture/ddp_no_sync.py).

As under torch.compile, DDP's own methods (`_pre_forward`, `_post_forward`,
`_inside_ddp_forward`) are called: DDP has no public hook for what it does around its
module. `_inside_ddp_forward` marks the module's call as inside DDP, which the graph
split at DDP's buckets (capture/ddp_split.py) reads."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchweld.capture.compiled_function import CompiledFunction
    from torchweld.capture.convert_frame import CompileSettings


def ddp_class() -> type | None:
    """torch's DistributedDataParallel, or None in a build of torch without torch.distributed."""
    if not torch.distributed.is_available():
        return None
    return torch.nn.parallel.DistributedDataParallel


def is_ddp(obj: object) -> bool:
    cls = ddp_class()
    return cls is not None and isinstance(obj, cls)


def active_ddp_module() -> torch.nn.Module | None:
    """The DDP module whose forward is running its module now (set by DDP's `_inside_ddp_forward`,
    whether the DDP module is compiled or eager), or None."""
    cls = ddp_class()
    return None if cls is None else cls._get_active_ddp_module()


def call_module(module: torch.nn.Module, *args, **kwargs):
    """`module(*args, **kwargs)`, captured with the module's hooks as nn.Module.__call__ runs them."""
    return module(*args, **kwargs)


def call_forward(module: torch.nn.Module, *args, **kwargs):
    """`module.forward(*args, **kwargs)`: no hooks (DDP's path where its delayed all-reduce covers every
    parameter: `_delay_all_reduce_all_params`, set by the private delay_all_reduce_named_params; no test
    reaches it, DDP's constructor refuses it on the CPU)."""
    return module.forward(*args, **kwargs)


# what DDPForward calls or reads of a DDP module (torch 2.1 to 2.13 have them all)
_DDP_INTERNALS = ("_pre_forward", "_post_forward", "_inside_ddp_forward", "_delay_all_reduce_all_params",
                  "_use_python_reducer", "module")


class DDPForward:
    """`DistributedDataParallel.forward(ddp, *inputs, **kwargs)` with `ddp.module`'s call compiled.
    One per compile settings; bound to a DDP module with `types.MethodType`."""

    def __init__(self, settings: "CompileSettings", request: object | None = None):
        from torchweld.capture.compiled_function import CompiledFunction

        # compiled call_module and call_forward: their cache entries guard the module's identity
        self.inner = CompiledFunction(call_module, settings, request)
        self.inner_forward = CompiledFunction(call_forward, settings, request)
        self.request = request
        self.checked: weakref.WeakSet = weakref.WeakSet()  # DDP modules that have what __call__ uses
        self.__name__ = self.__qualname__ = "DistributedDataParallel.forward"

    @property
    def cache_entries(self) -> list:
        return self.inner.cache_entries + self.inner_forward.cache_entries

    def __call__(self, ddp: torch.nn.Module, *inputs, **kwargs):
        if ddp not in self.checked:  # once a module: six hasattr a call cost 1.6 of 22 us
            if not all(hasattr(ddp, name) for name in _DDP_INTERNALS):  # another torch's DDP: run it as it is
                return type(ddp).forward(ddp, *inputs, **kwargs)
            self.checked.add(ddp)
        inputs, kwargs = ddp._pre_forward(*inputs, **kwargs)
        if ddp._delay_all_reduce_all_params:  # every parameter's all-reduce delayed: DDP calls module.forward
            output = self.inner_forward(ddp.module, *inputs, **kwargs)
        elif ddp._use_python_reducer:
            output = self.inner(ddp.module, *inputs, **kwargs)
        else:
            with ddp._inside_ddp_forward():
                output = self.inner(ddp.module, *inputs, **kwargs)
        return ddp._post_forward(output)


def ddp_forward(settings: "CompileSettings", request: object | None = None) -> DDPForward:
    """The DDPForward of these settings, made once (held by the entries that call it)."""
    return settings.wrapper(("ddp forward",), lambda: DDPForward(settings, request))

