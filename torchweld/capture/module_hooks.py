"""A module's forward pre-hooks and forward hooks, inlined around its forward in the order
`nn.Module.__call__` runs them (the global ones first), with what they registered guarded:
the names in each hook dict and each hook by identity, so adding or removing a hook
recompiles. Backward hooks need autograd's own wrapping at run time: a module that has
any is called natively, at a graph break, as eager calls it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.sources import AttrSource, ItemSource, ModuleGlobalSource, Source
from torchweld.capture.values import ConstantValue, DictValue, TupleValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

_GLOBALS = torch.nn.modules.module
_GLOBALS_NAME = "torch.nn.modules.module"
# (hook dict, the dict of hook ids called with kwargs too), as nn.Module.__call__ reads them
_PRE = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
_POST = ("_forward_hooks", "_forward_hooks_with_kwargs")


def has_backward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._backward_hooks or module._backward_pre_hooks or _GLOBALS._global_backward_hooks
                or _GLOBALS._global_backward_pre_hooks)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or _GLOBALS._global_forward_hooks
                or _GLOBALS._global_forward_pre_hooks)


def call_with_hooks(tx: "Translator", module_value: Value, args: list[Value], kwargs: dict[str, Value],
                    forward: Callable[[list[Value], dict[str, Value]], Value]) -> Value:
    """`module(*args, **kwargs)` with its forward hooks inlined around `forward`."""
    module, source = module_value.module, module_value.source
    if source is None:
        raise Unsupported(f"a {type(module).__name__} with hooks reached without a source")
    if has_backward_hooks(module):
        raise Unsupported(f"module {type(module).__name__} has backward hooks, which autograd runs: called in Python")
    guards = tx.output.guards
    guards.length(AttrSource(source, "_backward_hooks"), type(module._backward_hooks), 0)
    guards.length(AttrSource(source, "_backward_pre_hooks"), type(module._backward_pre_hooks), 0)
    guards.lacks(AttrSource(source, "__dict__"), "forward")
    call_args, call_kwargs = TupleValue(list(args)), DictValue(dict(kwargs))
    for hook, with_kwargs in _hooks(tx, module, source, _PRE):
        if with_kwargs:
            result = hook.call(tx, [module_value, call_args, call_kwargs], {})
            if not _is_none(tx, result):
                items = result.items(tx)
                if len(items) != 2 or not isinstance(items[1], DictValue):
                    raise Unsupported("a forward pre-hook with kwargs returned something else than (args, kwargs) "
                                      "(the eager call raises RuntimeError)")
                call_args, call_kwargs = TupleValue(items[0].items(tx)), items[1]
        else:
            result = hook.call(tx, [module_value, call_args], {})
            if not _is_none(tx, result):
                call_args = result if isinstance(result, TupleValue) else TupleValue([result])
    output = forward(call_args.items(tx), dict(call_kwargs.entries))
    for hook, with_kwargs in _hooks(tx, module, source, _POST):
        hook_args = [module_value, call_args, call_kwargs, output] if with_kwargs else [module_value, call_args, output]
        result = hook.call(tx, hook_args, {})
        if not _is_none(tx, result):
            output = result
    return output


def _hooks(tx: "Translator", module: torch.nn.Module, source: Source, names: tuple[str, str]):
    """The global hooks, then the module's, each as (its value, whether it takes kwargs); the
    dicts' keys guarded (hooks are registered and removed between calls)."""
    from torchweld.capture.builder import wrap

    guards = tx.output.guards
    hooks_name, kwargs_name = names
    global_source = ModuleGlobalSource(_GLOBALS_NAME, f"_global{hooks_name}")
    global_kwargs = getattr(_GLOBALS, f"_global{kwargs_name}", {})
    found = []
    for owner, hooks, with_kwargs, dict_source in (
            (_GLOBALS, getattr(_GLOBALS, f"_global{hooks_name}"), global_kwargs, global_source),
            (module, getattr(module, hooks_name), getattr(module, kwargs_name), AttrSource(source, hooks_name))):
        if owner is _GLOBALS and not hooks:
            guards.no_global_hooks(dict_source, type(hooks))  # as for modules without hooks
        else:
            guards.keys_are(dict_source, type(hooks), list(hooks))
        if owner is module:
            guards.keys_are(AttrSource(source, kwargs_name), type(with_kwargs), list(with_kwargs))
        for hook_id, hook in hooks.items():
            found.append((wrap(tx, hook, ItemSource(dict_source, hook_id)), hook_id in with_kwargs))
    return found


def _is_none(tx: "Translator", value: Value) -> bool:
    from torchweld.capture import operators

    return operators.is_same(tx, value, ConstantValue(None))
