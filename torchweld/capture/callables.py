"""Values that can be called: torch functions (graph nodes), tensor and container
methods, user functions (inlined), bound methods and grad-mode context managers."""
from __future__ import annotations

import functools
import types

import torch
import torch.utils._pytree as pytree

from torchweld.capture.sources import AttrSource, Source
from torchweld.capture.values import (
    ConstantValue, DictValue, ListValue, SequenceValue, TupleValue, Value, const,
)
from torchweld.errors import Unsupported



def _constant_args(args: list[Value], kwargs: dict[str, Value]) -> tuple[list, dict]:
    return [a.as_constant() for a in args], {k: v.as_constant() for k, v in kwargs.items()}


# ---------------------------------------------------------------------------
# methods of constants and containers (evaluated at capture time)
# ---------------------------------------------------------------------------


def _evaluated(what: str, run):
    """`run()` at capture time; an exception it raises is the eager run's, at the user's line."""
    from torchweld.capture.exceptions import CapturedRaise

    try:
        return run()
    except (LookupError, ValueError, TypeError, ArithmeticError) as e:
        raise CapturedRaise.like(e) from None


class ConstantMethodValue(Value):
    def __init__(self, obj: object, name: str):
        self.obj, self.name = obj, name

    def call(self, tx, args, kwargs):
        a, k = _constant_args(args, kwargs)
        return const(_evaluated(f"{type(self.obj).__name__}.{self.name}()", lambda: getattr(self.obj, self.name)(*a, **k)))


_LIST_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"}
_DICT_MUTATORS = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}


class ContainerMethodValue(Value):
    """`lst.append`, `d.items`, `t.index`, ... on a container value."""

    def __init__(self, container: Value, name: str):
        self.container, self.name = container, name

    def call(self, tx, args, kwargs):
        c, name = self.container, self.name
        what = f"{c.python_type().__name__}.{name}()"
        if isinstance(c, ListValue) and name in _LIST_MUTATORS:
            c.mutate(tx)
            return _evaluated(what, lambda: _mutate_list(c, name, args, kwargs))
        if isinstance(c, DictValue):
            if name in _DICT_MUTATORS:
                c.mutate(tx)
                return _evaluated(what, lambda: _mutate_dict(tx, c, name, args, kwargs))
            if name == "items":
                return ListValue([TupleValue([const(k), v]) for k, v in c.entries.items()])
            if name == "keys":
                return ListValue([const(k) for k in c.entries])
            if name == "values":
                return ListValue(list(c.entries.values()))
            if name == "get":
                key = args[0].as_constant()
                default = args[1] if len(args) > 1 else ConstantValue(None)
                return c.entries.get(key, default)
            if name == "copy":
                return DictValue(c.entries)
        if isinstance(c, SequenceValue) and name in ("index", "count"):
            return const(_evaluated(what, lambda: getattr(c.as_constant(), name)(*_constant_args(args, kwargs)[0])))
        if isinstance(c, ListValue) and name == "copy":
            return ListValue(c.elements)
        raise Unsupported(f"{c.python_type().__name__}.{name}() is not supported in capture")


def _mutate_list(lst: ListValue, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value:
    items = lst.elements
    if name == "append":
        items.append(args[0])
    elif name == "extend":
        items.extend(args[0].items(None))
    elif name == "insert":
        items.insert(args[0].as_constant(), args[1])
    elif name == "pop":
        return items.pop(args[0].as_constant() if args else -1)
    elif name == "clear":
        items.clear()
    elif name == "reverse":
        items.reverse()
    elif name == "__setitem__":
        key = args[0].as_constant()
        if isinstance(key, slice):
            items[key] = args[1].items(None)
        else:
            items[key] = args[1]
    elif name == "__delitem__":
        del items[args[0].as_constant()]
    else:
        raise Unsupported(f"list.{name}() is not supported in capture")
    return ConstantValue(None)


def _mutate_dict(tx, d: DictValue, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value:
    e = d.entries
    if name == "__setitem__":
        e[args[0].as_constant()] = args[1]
    elif name == "__delitem__":
        del e[args[0].as_constant()]
    elif name == "update":
        if args:
            other = args[0]
            if not isinstance(other, DictValue):
                raise Unsupported("dict.update() with a non-dict")
            e.update(other.entries)
        e.update(kwargs)
    elif name == "pop":
        key = args[0].as_constant()
        if key in e:
            return e.pop(key)
        if len(args) > 1:
            return args[1]
        from torchweld.capture.exceptions import CapturedRaise

        raise CapturedRaise.of(KeyError, key)
    elif name == "setdefault":
        return e.setdefault(args[0].as_constant(), args[1] if len(args) > 1 else ConstantValue(None))
    elif name == "clear":
        e.clear()
    else:
        raise Unsupported(f"dict.{name}() is not supported in capture")
    return ConstantValue(None)


# ---------------------------------------------------------------------------
# torch: functions and tensor methods become graph nodes
# ---------------------------------------------------------------------------

# torch callables that change global state or leave the graph; never run on fake tensors
_TORCH_NOT_IN_GRAPH = {
    "manual_seed", "seed", "initial_seed", "save", "load", "use_deterministic_algorithms", "get_rng_state",
    "set_rng_state", "compile", "backward", "register_hook", "item", "tolist", "numpy", "data_ptr",
    "synchronize", "record_stream", "retain_grad", "untyped_storage", "storage", "is_grad_enabled",
    # a tensor's state that its guard does not check: asked of the real tensor, at a break
    "storage_offset", "is_inference", "is_conj", "is_neg", "is_pinned", "is_shared", "output_nr",
}


def _check_graphable(name: str) -> None:
    if name in _TORCH_NOT_IN_GRAPH or name.startswith("set_"):
        reason = {
            "item": "data-dependent: Tensor.item() reads a tensor's value out of the graph",
            "tolist": "data-dependent: Tensor.tolist() reads a tensor's values out of the graph",
            "numpy": "Tensor.numpy() leaves torch for numpy",
        }.get(name, f"torch {name}() changes global state or needs Python")
        raise Unsupported(reason)


def _check_not_collective(fn: object, name: str) -> None:
    """Raise Unsupported for a torch.distributed function that is not a query (`all_reduce`,
    `broadcast`, `barrier`, the functional collectives): it communicates with other processes,
    and runs in Python between graphs, in the order and on the ranks eager runs it. (In a graph,
    an all_reduce whose result nobody reads was dropped as dead code, without a word.)"""
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("torch.distributed") and not _is_runtime_query(name):
        raise Unsupported(f"torch.distributed {name}() communicates with other processes: it runs in Python "
                          "between graphs")


def _compiling_answer(fn: object) -> bool | None:
    """What `torch.compiler.is_compiling()` and its older spellings answer inside a
    captured frame: True, as under PyTorch's own compiler, so that libraries take their
    compile-friendly paths. torchweld is not TorchDynamo: `is_dynamo_compiling()` is False."""
    module, name = getattr(fn, "__module__", None) or "", getattr(fn, "__name__", None)
    if name == "is_compiling" and module.startswith("torch."):  # torch.compiler's and its deprecated aliases
        return True
    if name in ("is_dynamo_compiling", "is_exporting") and module == "torch.compiler":
        return False
    return None


# queries whose answer is fixed for the life of the process (the hardware, how torch was built)
_PROCESS_CONSTANTS = {"is_available", "device_count", "get_device_capability", "get_device_name",
                      "get_device_properties", "is_built", "is_bf16_supported"}


def _is_runtime_query(name: str) -> bool:
    return name.startswith(("is_", "get_", "_is_")) or name in ("device_count", "current_device")


class TorchCallableValue(Value):
    """A function of torch (`torch.sin`, `F.relu`, `torch._C._nn.linear`)."""

    def __init__(self, fn: object, source: Source | None = None):
        self.fn = fn
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return type(self.fn)

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        from torchweld.capture.mode_calls import mode_call

        special = mode_call(tx, self.fn, args, kwargs)
        if special is not None:
            return special
        compiling = _compiling_answer(self.fn)
        if compiling is not None:
            return ConstantValue(compiling)
        if self.fn is torch._C._log_api_usage_once:  # usage telemetry (torchvision's layers): no graph node
            return ConstantValue(None)
        name = getattr(self.fn, "__name__", "")
        _check_graphable(name)
        _check_not_collective(self.fn, name)
        if _is_runtime_query(name) and all(v.is_constant() for v in [*args, *kwargs.values()]):
            # torch.cuda.is_available(), torch.get_default_dtype(): asked of the process, not of data
            a, k = _constant_args(args, kwargs)
            try:
                with tx.output.in_autocast_regions():  # torch.is_autocast_enabled() inside a region
                    answer = self.fn(*a, **k)
            except Exception as e:  # e.g. a CUDA query in a CPU-only build: Python shall run it
                raise Unsupported(f"torch.{name}() raised {type(e).__name__}: {e}") from None
            if name in _PROCESS_CONSTANTS or tx.output.autocast_regions:  # (autocast: guarded as a whole)
                return const(answer)
            return asked_each_call(tx, self, answer, tuple(a), k)  # a setting the program may change
        return tx.output.call_function(self.fn, args, kwargs)

    def getattr(self, tx, name):
        from torchweld.capture.builder import wrap

        return wrap(tx, getattr(self.fn, name), AttrSource(self.source, name) if self.source else None)

    def __repr__(self) -> str:
        return f"TorchCallableValue({getattr(self.fn, '__name__', self.fn)})"


class TensorMethodValue(Value):
    def __init__(self, tensor: Value, name: str):
        self.tensor, self.name = tensor, name

    def call(self, tx, args, kwargs):
        _check_graphable(self.name)
        return tx.output.call_method(self.name, [self.tensor, *args], kwargs)


# ---------------------------------------------------------------------------
# user functions: inlined
# ---------------------------------------------------------------------------


class UserFunctionValue(Value):
    """A Python function defined by the user; calling it inlines its bytecode."""

    def __init__(self, fn: types.FunctionType, source: Source | None = None):
        self.fn = fn
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return types.FunctionType

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        from torchweld.capture.inline import inline_user_function

        return inline_user_function(tx, self, args, kwargs)

    def getattr(self, tx, name):
        if name in ("__name__", "__qualname__", "__module__", "__doc__"):
            return const(getattr(self.fn, name))
        if name == "__code__":  # guarded by the function's identity
            return ConstantValue(self.fn.__code__)
        if name in ("__wrapped__", "__defaults__", "__kwdefaults__", "__dict__", "__globals__"):
            from torchweld.capture.builder import wrap
            from torchweld.capture.sources import AttrSource

            if self.source is None:
                raise Unsupported(f"reading {name!r} of function {self.fn.__qualname__} reached without a source")
            return wrap(tx, getattr(self.fn, name), AttrSource(self.source, name))
        raise Unsupported(f"reading {name!r} of function {self.fn.__qualname__}")

    def __repr__(self) -> str:
        return f"UserFunctionValue({self.fn.__qualname__})"


class NestedFunctionValue(Value):
    """A function made in the frame (MAKE_FUNCTION: lambdas, nested defs, comprehensions)."""

    def __init__(self, code: types.CodeType, f_globals: dict, defaults: tuple[Value, ...],
                 kwdefaults: dict[str, Value], closure: tuple[Value, ...]):
        self.code = code
        self.f_globals = f_globals
        self.defaults = defaults
        self.kwdefaults = kwdefaults
        self.closure = closure  # CellValues

    def python_type(self) -> type:
        return types.FunctionType

    def call(self, tx, args, kwargs):
        from torchweld.capture.inline import inline_user_function

        return inline_user_function(tx, self, args, kwargs)

    def __repr__(self) -> str:
        return f"NestedFunctionValue({self.code.co_qualname})"


class BoundMethodValue(Value):
    """`obj.method` for a user method: calling it passes `obj` as the first argument."""

    def __init__(self, func: Value, self_value: Value, source: Source | None = None):
        self.func, self.self_value = func, self_value
        self.source = source

    def python_type(self) -> type:
        return types.MethodType

    def call(self, tx, args, kwargs):
        return self.func.call(tx, [self.self_value, *args], kwargs)


class PartialValue(Value):
    """`functools.partial(fn, *args, **keywords)`: calling it calls `fn` with those first.
    Made in the frame, or read from outside (its type, function and arguments guarded)."""

    def __init__(self, func: Value, args: list[Value], keywords: dict[str, Value], source: Source | None = None):
        self.func, self.args, self.keywords = func, args, keywords
        self.source = source

    def python_type(self) -> type:
        return functools.partial

    def call(self, tx, args, kwargs):
        return self.func.call(tx, [*self.args, *args], {**self.keywords, **kwargs})


class CachedFunctionValue(Value):
    """A `functools.lru_cache` function (`is_torch_available()`). Called with constants, its
    cached answer is a constant of the capture, as the eager call returns it; called with
    tensors or other values, its function is inlined (the cache is left untouched)."""

    def __init__(self, fn: object, wrapped: Value, source: Source | None = None):
        self.fn, self.wrapped = fn, wrapped
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return type(self.fn)

    def call(self, tx, args, kwargs):
        if all(v.is_constant() for v in [*args, *kwargs.values()]):
            a, k = _constant_args(args, kwargs)
            try:
                answer = self.fn(*a, **k)
            except Exception as e:  # the eager call raises it at the user's line
                raise Unsupported(f"{getattr(self.fn, '__qualname__', self.fn)} raised {type(e).__name__}: {e}") from None
            return asked_each_call(tx, self, answer, tuple(a), k)  # `cache_clear()` may change it
        return self.wrapped.call(tx, args, kwargs)


def asked_each_call(tx, fn: Value, answer: object, args: tuple, kwargs: dict) -> Value:
    """The `answer` of calling `fn` with constants, as a value read from a source that makes
    the same call: guarded like any value from outside (on every call of the compiled code)."""
    from torchweld.capture.builder import wrap

    guards = tx.output.guards
    function = fn.source or guards.source_of(fn.real_object())
    return wrap(tx, answer, guards.call_result_source(function, args, kwargs))


class AllowedInGraphValue(Value):
    """A function marked with `torch.compiler.allow_in_graph`: one graph node, as a torch
    function is (capture does not look inside it; the backend traces through it)."""

    def __init__(self, fn: types.FunctionType, source: Source | None = None):
        self.fn = fn
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return types.FunctionType

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        return tx.output.call_function(self.fn, args, kwargs)


class AssumedConstantValue(Value):
    """A function marked with `torch.compiler.assume_constant_result`: called once, at capture,
    with constant arguments; its answer is a constant of the graph and, as under torch.compile,
    never checked again (the marker is the user's promise that it cannot change)."""

    def __init__(self, fn: types.FunctionType, source: Source | None = None):
        self.fn = fn
        self.source = source

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return types.FunctionType

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        from torchweld.capture.builder import wrap

        name = self.fn.__qualname__
        if not all(v.is_constant() for v in [*args, *kwargs.values()]):
            raise Unsupported(f"{name} is marked with assume_constant_result and is called with a value that is not "
                              "a constant")
        a, k = _constant_args(args, kwargs)
        try:
            answer = self.fn(*a, **k)
        except Exception as e:  # the eager call raises it at the user's line
            raise Unsupported(f"{name} (assume_constant_result) raised {type(e).__name__}: {e}") from None
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(answer)):
            raise Unsupported(f"{name} is marked with assume_constant_result and returned a tensor")
        return wrap(tx, answer, None, guard=False)


class OpaqueCallableValue(Value):
    """A callable capture cannot look into (print, numpy, C extensions): calling it
    needs Python, so the frame cannot be captured past that call."""

    def __init__(self, fn: object, reason: str, source: Source | None = None):
        self.fn = fn
        self.reason = reason
        self.source = source  # where a break reloads it from: a bound method is per call (`s.add` of a new set)

    def real_object(self) -> object:
        return self.fn

    def python_type(self) -> type:
        return type(self.fn)

    def as_constant(self) -> object:
        return self.fn

    def call(self, tx, args, kwargs):
        raise Unsupported(self.reason)
