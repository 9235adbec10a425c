"""Call a module as `nn.Module.__call__` does, with its forward compiled: its forward pre-hooks
and forward hooks run natively in Python around the compiled forward, on every call.

For hooks capture must not trace: FSDP2's (`fully_shard`), which all-gather parameters before
the forward, free them after it and arm the backward's reduce-scatter, and any hooks of a
module given to `torchweld.compile` (which before ran the whole module eagerly). Modules with
backward hooks or with global module hooks are called as they are (`module(...)`): their
hooks are wired by `nn.Module.__call__` itself."""
from __future__ import annotations

import sys
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from torchweld.capture.convert_frame import CompileSettings


def fsdp_module_class() -> type | None:
    """FSDP2's FSDPModule (what `fully_shard` makes a module an instance of), or None. None
    too while torch.distributed.fsdp is not imported: no module can be sharded then, and
    importing it (with DTensor's operator tables) cost a program that never shards 0.2-0.3 s
    at its first compile."""
    if not torch.distributed.is_available() or "torch.distributed.fsdp" not in sys.modules:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_fsdp_managed(module: object) -> bool:
    cls = fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def hooks_run_natively(module: torch.nn.Module) -> bool:
    """Whether `call_with_native_hooks` runs all of `module`'s hooks: it has forward (pre-)hooks
    only, and no module anywhere has global hooks."""
    hooks = torch.nn.modules.module
    return not (module._backward_hooks or module._backward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks or "forward" in module.__dict__)


def call_with_native_hooks(module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict):
    """`module(*args, **kwargs)` with `forward` for its forward: nn.Module._call_impl's handling of
    forward pre-hooks and forward hooks (with_kwargs, always_call), in its order."""
    result, called_always = None, set()
    try:
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hook_id in module._forward_pre_hooks_with_kwargs:
                new = hook(module, args, kwargs)
                if new is not None:
                    if not (isinstance(new, tuple) and len(new) == 2):
                        raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                           f"but got {new}.")
                    args, kwargs = new
            else:
                new = hook(module, args)
                if new is not None:
                    args = new if isinstance(new, tuple) else (new,)
        result = forward(*args, **kwargs)
        for hook_id, hook in list(module._forward_hooks.items()):
            if hook_id in module._forward_hooks_always_called:
                called_always.add(hook_id)
            result = _forward_hook(module, hook_id, hook, args, kwargs, result)
        return result
    except Exception:
        for hook_id, hook in list(module._forward_hooks.items()):
            if hook_id not in module._forward_hooks_always_called or hook_id in called_always:
                continue
            try:
                result = _forward_hook(module, hook_id, hook, args, kwargs, result)
            except Exception as e:
                warnings.warn("module forward hook with ``always_call=True`` raised an exception that was silenced "
                              f"as another error was raised in forward: {e}", stacklevel=2)
        raise


class NativeHooksCall:
    """`module(*args, **kwargs)` at a graph break, for a module whose hooks run natively: its
    class's forward `function` compiled, one compiled function per module (as
    `torchweld.compile(block)` per block: the blocks of a deep model are not versions of one
    cache, whose size limit would leave the later ones eager). Bound with `types.MethodType`."""

    def __init__(self, function: types.FunctionType, settings: "CompileSettings"):
        self.function, self.settings = function, settings
        self.forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, module: torch.nn.Module, *args, **kwargs):
        if not hooks_run_natively(module):
            return module(*args, **kwargs)
        forward = self.forwards.get(module)
        if forward is None:
            from torchweld.capture.compiled_function import CompiledFunction

            forward = self.forwards[module] = CompiledFunction(self.function, self.settings)
        return call_with_native_hooks(module, types.MethodType(forward, module), args, kwargs)


def _forward_hook(module, hook_id, hook, args, kwargs, result):
    """`result` after forward hook `hook` (its replacement where it returns one)."""
    if hook_id in module._forward_hooks_with_kwargs:
        new = hook(module, args, kwargs, result)
    else:
        new = hook(module, args, result)
    return result if new is None else new
