"""Turn a real Python object that enters the frame into a Value of the right kind,
guarding what the capture will assume about it.

Soundness (README, "Soundness"): a Value made here keeps its source, so that compiled code
reads the object anew at every call, and carries the guards for what capture folds from it
(constants by value, functions and modules by identity, containers by length and keys)."""
from __future__ import annotations

import functools
import os
import types
from typing import TYPE_CHECKING

import torch

from torchweld.capture.autocast import AUTOCAST_METHODS
from torchweld import torch_controls
from torchweld.capture.callables import (
    AllowedInGraphValue, AssumedConstantValue, CachedFunctionValue, OpaqueCallableValue, PartialValue,
    TorchCallableValue, UserFunctionValue,
)
from torchweld.capture.checkpoint import CheckpointValue, is_checkpoint
from torchweld.capture.environ import EnvironValue
from torchweld.capture.objects import (
    ClassValue, NNModuleValue, PythonModuleValue, UserObjectValue, is_stateless_standard_module,
)
from torchweld.capture.sources import AttrSource, ItemSource, Source
from torchweld.capture.values import (
    ConstantValue, DictValue, GuardedOnUseNumber, ListValue, TupleValue, Value, is_constant_literal,
)
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


# Libraries whose functions always run natively: they compute on real data.
NATIVE_ONLY_MODULES = {"numpy", "scipy", "pandas", "logging", "warnings", "os", "sys", "time", "random", "pdb"}


def is_torch_callable(obj: object) -> bool:
    """A function torch defines, called as one graph node rather than inlined."""
    module = getattr(obj, "__module__", None) or ""
    if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return module.startswith("torch") or getattr(obj, "__self__", None) is torch._C._VariableFunctions
    if isinstance(obj, types.FunctionType):  # F.relu, torch.functional.einsum; not methods of nn modules
        return (module.startswith("torch.") and not module.startswith("torch.nn.modules")
                and "." not in obj.__qualname__ and "_contextlib" not in obj.__code__.co_filename)
    return isinstance(obj, torch._ops.OpOverloadPacket) or isinstance(obj, torch._ops.OpOverload)


# torch's own lazy variant of `torch.compiler.disable` wraps functions in a closure defined here.
_TORCH_LAZY_DISABLE_FILE = os.path.join(os.path.dirname(torch.__file__), "_compile.py")


def is_marked_by_torch_to_run_eagerly(fn: types.FunctionType) -> bool:
    """`torch.compiler.disable` leaves a marker attribute on the wrapper it returns;
    torch's internal lazy form (on optimizer bookkeeping methods) has none until its first call."""
    return bool(getattr(fn, "_torchdynamo_disable", False)) or fn.__code__.co_filename == _TORCH_LAZY_DISABLE_FILE


def _holds_number_inputs(tx: "Translator", obj: object, source: Source | None) -> bool:
    """Whether `obj` is a tuple with an item read as a GuardedOnUseNumber (Adam's betas):
    then it is wrapped item by item, not as one constant."""
    return (type(obj) is tuple and source is not None and bool(tx.output.number_input_sources)
            and any(ItemSource(source, i).name() in tx.output.number_input_sources for i in range(len(obj))))


def _read_as_input(tx: "Translator", number: float, source: Source) -> bool:
    """Whether the float `number` read from `source` may be a graph input: an optimizer's
    hyperparameter (optimizers.py), or a float argument that varies (dynamic_dims.py)."""
    if source.name() in tx.output.number_input_sources:
        return True
    return tx.output.dims is not None and tx.output.dims.float_is_input(source, number)


def marked_disabled(obj: object) -> bool:
    """Marked with torchweld.disable; asked safely of objects whose __getattr__ answers anything
    (torch.classes) or raises something else than AttributeError."""
    try:
        return getattr(obj, "__torchweld_disabled__", False) is True
    except Exception:
        return False


def wrap(tx: "Translator", obj: object, source: Source | None, guard: bool = True) -> Value:
    """The Value for `obj`, read from `source`; `guard=False` trusts it never changes."""
    from torchweld.capture.builtins import BuiltinValue, is_modelled_builtin

    guards = tx.output.guards if (guard and source is not None) else None

    if marked_disabled(obj):
        return OpaqueCallableValue(obj, f"{getattr(obj, '__qualname__', obj)} is marked with torchweld.disable", source)
    if torch_controls.is_graph_break(obj):
        return OpaqueCallableValue(obj, "torchweld.graph_break() asks for a graph break here", source)
    if torch_controls.is_torch_compiled(obj):  # torch.compile's own wrapper: run it as it is, compiled by torch
        what = f"module {type(obj._orig_mod).__name__}" if isinstance(obj, torch.nn.Module) else obj.__qualname__
        return OpaqueCallableValue(obj, f"{what} was compiled with torch.compile: it runs as it is, outside torchweld's graph",
                                   source)
    if isinstance(obj, torch.Tensor):
        if source is None:
            raise Unsupported("a tensor reached the frame without a source to read it from")
        return tx.output.input_tensor(source, obj)
    if guards and type(obj) is float and _read_as_input(tx, obj, source):
        return GuardedOnUseNumber(obj, source, guards)
    if guards and type(obj) is int and tx.output.dims is not None and tx.output.dims.int_is_symbolic(source, obj):
        return tx.output.input_int(source, obj)  # a size or count passed in, symbolic (dynamic_dims.py)
    if is_constant_literal(obj) and not _holds_number_inputs(tx, obj, source):
        if guards:
            guards.constant(source, obj)
        return ConstantValue(obj, source)
    if type(obj) in (list, dict) and source is not None:  # one Value per mutable object: mutations stay shared
        known = tx.output.mutable_inputs.get(id(obj))
        if known is not None:
            tx.output.guards.same_object(source, known[1].source)
            return known[1]
    if type(obj) in (list, tuple):
        if guards:
            guards.length(source, type(obj), len(obj))
        items = [wrap(tx, item, ItemSource(source, i) if source else None, guard) for i, item in enumerate(obj)]
        value = (ListValue if type(obj) is list else TupleValue)(items, source)
        if type(obj) is list and source is not None:
            tx.output.mutable_inputs[id(obj)] = (obj, value)
        return value
    fields = getattr(type(obj), "_fields", None) or getattr(type(obj), "__match_args__", None)
    if isinstance(obj, tuple) and fields:  # named tuples, torch.return_types
        if guards:
            guards.type_is(source, type(obj))
        items = [wrap(tx, getattr(obj, f), AttrSource(source, f) if source else None, guard) for f in fields]
        return TupleValue(items, source, fields=tuple(fields), tuple_type=type(obj))
    if type(obj) is dict:
        keys = list(obj)
        if not all(is_constant_literal(k) for k in keys):
            raise Unsupported("a dict whose keys are not constants")
        if guards:
            guards.dict_keys(source, keys)
        value = DictValue({k: wrap(tx, v, ItemSource(source, k) if source else None, guard) for k, v in obj.items()}, source)
        if source is not None:
            tx.output.mutable_inputs[id(obj)] = (obj, value)
        return value
    if obj is os.environ:
        if guards:
            guards.identity(source, obj)
        return EnvironValue(source)
    if isinstance(obj, torch.nn.Module):
        if guards:
            if is_stateless_standard_module(obj):  # made anew per call (a loss): any instance will do
                guards.type_is(source, type(obj))
            else:
                guards.identity(source, obj)
        return NNModuleValue(obj, source)
    if type(obj) is functools.partial:
        if guards:
            guards.type_is(source, functools.partial)
        part = (lambda name: AttrSource(source, name)) if source else (lambda name: None)
        args = wrap(tx, obj.args, part("args"), guard).items(tx)
        keywords = wrap(tx, obj.keywords, part("keywords"), guard).entries
        return PartialValue(wrap(tx, obj.func, part("func"), guard), args, dict(keywords), source)
    if isinstance(obj, functools._lru_cache_wrapper):
        if guards:
            guards.identity(source, obj)
        wrapped = wrap(tx, obj.__wrapped__, AttrSource(source, "__wrapped__") if source else None, guard)
        return CachedFunctionValue(obj, wrapped, source)
    if isinstance(obj, types.FunctionType) and torch_controls.allowed_in_graph(obj):
        if guards:
            guards.identity(source, obj)
        return AllowedInGraphValue(obj, source)
    if torch_controls.assumed_constant(obj):
        if guards:
            guards.identity(source, obj)
        return AssumedConstantValue(obj, source)
    if is_checkpoint(obj):  # marked to run without compilers; capture inlines it (checkpoint.py)
        if guards:
            guards.identity(source, obj)
        return CheckpointValue(source)
    if isinstance(obj, types.FunctionType) and is_marked_by_torch_to_run_eagerly(obj):
        return OpaqueCallableValue(obj, f"{obj.__qualname__} is marked by torch to run without compilers", source)
    if is_torch_callable(obj):
        if guards:
            guards.identity(source, obj)
        return TorchCallableValue(obj, source)
    if is_modelled_builtin(obj):
        if guards:
            guards.identity(source, obj)
        return BuiltinValue(obj, source)
    if isinstance(obj, types.FunctionType):
        if guards:
            guards.identity(source, obj)
        root = (getattr(obj, "__module__", None) or "").split(".")[0]
        if root in NATIVE_ONLY_MODULES:
            return OpaqueCallableValue(obj, f"call to {root} function {obj.__qualname__} needs Python", source)
        if obj.__code__ in AUTOCAST_METHODS:  # a resume function's `with` slot: a region begun before its graph
            return OpaqueCallableValue(obj, "entering or leaving a torch.autocast region begun outside this graph needs Python",
                                       source)
        return UserFunctionValue(obj, source)
    if isinstance(obj, types.MethodType):
        from torchweld.capture.callables import BoundMethodValue

        func = wrap(tx, obj.__func__, AttrSource(source, "__func__") if source else None, guard)
        owner = wrap(tx, obj.__self__, AttrSource(source, "__self__") if source else None, guard)
        return BoundMethodValue(func, owner, source)
    if isinstance(obj, types.ModuleType):
        if guards:
            guards.identity(source, obj)
        return PythonModuleValue(obj, source)
    if isinstance(obj, type):
        if guards:
            guards.identity(source, obj)
        return ClassValue(obj, source)
    if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType)):
        name = getattr(obj, "__qualname__", None) or repr(obj)
        return OpaqueCallableValue(obj, f"call to {name}, a function capture does not model", source)
    if source is None:
        raise Unsupported(f"a {type(obj).__name__} object without a source")
    if guards:
        guards.type_is(source, type(obj))
    return UserObjectValue(obj, source)
