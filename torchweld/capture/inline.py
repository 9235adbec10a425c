"""Inlining a call to a user function: bind its arguments to Values and run its
bytecode in a child Translator that records into the same graph."""
from __future__ import annotations

import inspect
import types
from typing import TYPE_CHECKING

from torchweld import config
from torchweld.capture.sources import AttrSource, ClosureSource, DefaultSource, Source
from torchweld.capture.values import (
    CellValue, DictValue, IteratorValue, TupleValue, Value, const, is_constant_literal,
)
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.callables import NestedFunctionValue, UserFunctionValue
    from torchweld.capture.translator import Translator

_NOT_INLINABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


class RealCellValue(Value):
    """A closure cell of a real function: its contents are read through a source."""

    def __init__(self, cell: types.CellType, source: Source | None):
        self.cell = cell
        self.source = source
        self.loaded: Value | None = None

    def load(self, tx: "Translator") -> Value:
        from torchweld.capture.builder import wrap

        if self.loaded is None:
            try:
                contents = self.cell.cell_contents
            except ValueError:
                raise Unsupported("free variable referenced before assignment") from None
            if self.source is None and not _is_plain_constant(contents):
                raise Unsupported("a closure variable of a function reached without a source")
            self.loaded = wrap(tx, contents, self.source)
        return self.loaded


def _is_plain_constant(obj: object) -> bool:
    try:
        const(obj)
        return True
    except Unsupported:
        return False


class _Default:
    """Marks a parameter filled by its default, for `inspect.Signature.bind`."""

    def __init__(self, key: int | str):
        self.key = key


def _bind(code: types.CodeType, n_defaults: int, kwdefault_names: list[str], args: list[Value],
          kwargs: dict[str, Value]) -> dict[str, object]:
    stand_in = types.FunctionType(code, {}, code.co_name, tuple(_Default(i) for i in range(n_defaults)),
                                  tuple(types.CellType() for _ in code.co_freevars))
    stand_in.__kwdefaults__ = {name: _Default(name) for name in kwdefault_names}
    try:
        bound = inspect.signature(stand_in).bind(*args, **kwargs)
    except TypeError as e:
        from torchweld.capture.exceptions import CapturedRaise

        raise CapturedRaise.of(TypeError, f"{code.co_qualname}() {e}") from None
    bound.apply_defaults()
    # inspect renames the implicit `.0` argument of comprehensions; code names are the truth
    n_params = code.co_argcount + code.co_kwonlyargcount
    n_params += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return dict(zip(code.co_varnames[:n_params], bound.arguments.values()))


def inline_user_function(tx: "Translator", fn_value: "UserFunctionValue | NestedFunctionValue",
                         args: list[Value], kwargs: dict[str, Value]) -> Value:
    from torchweld.capture.builder import wrap
    from torchweld.capture.callables import NestedFunctionValue
    from torchweld.capture.translator import Translator

    nested = isinstance(fn_value, NestedFunctionValue)
    code = fn_value.code if nested else fn_value.fn.__code__
    # a generator expression runs to completion at capture time: its items are all known
    is_genexpr = code.co_name == "<genexpr>" and code.co_flags & inspect.CO_GENERATOR
    is_generator = bool(code.co_flags & inspect.CO_GENERATOR) and not is_genexpr
    if code.co_flags & _NOT_INLINABLE and not is_genexpr and not is_generator:
        raise Unsupported(f"{code.co_qualname} is a coroutine or async generator; capture does not inline those")
    if tx.depth >= config.inline_depth_limit:
        raise Unsupported(f"inlining deeper than config.inline_depth_limit={config.inline_depth_limit} (recursion?)")

    if nested:
        n_defaults, kw_names = len(fn_value.defaults), list(fn_value.kwdefaults)
    else:
        n_defaults = len(fn_value.fn.__defaults__ or ())
        kw_names = list(fn_value.fn.__kwdefaults__ or {})
    bound = _bind(code, n_defaults, kw_names, args, kwargs)

    def resolve_default(marker: _Default) -> Value:
        if nested:
            return fn_value.defaults[marker.key] if isinstance(marker.key, int) else fn_value.kwdefaults[marker.key]
        fn = fn_value.fn
        real = fn.__defaults__[marker.key] if isinstance(marker.key, int) else fn.__kwdefaults__[marker.key]
        if fn_value.source is None:
            return const(real)
        if isinstance(marker.key, int) and is_constant_literal(real):
            # the tuple is immutable: one identity guard on it covers every literal in it
            tx.output.guards.identity(AttrSource(fn_value.source, "__defaults__"), fn.__defaults__)
            return const(real)
        return wrap(tx, real, DefaultSource(fn_value.source, marker.key))

    symbolic_locals: dict[str, Value] = {}
    for name, value in bound.items():
        if isinstance(value, _Default):
            value = resolve_default(value)
        elif isinstance(value, tuple):  # *args
            value = TupleValue([resolve_default(v) if isinstance(v, _Default) else v for v in value])
        elif isinstance(value, dict):  # **kwargs
            value = DictValue(value)
        symbolic_locals[name] = value

    cells: dict[str, Value] = {}
    if nested:
        for name, cell in zip(code.co_freevars, fn_value.closure):
            cells[name] = cell
    else:
        for i, (name, cell) in enumerate(zip(code.co_freevars, fn_value.fn.__closure__ or ())):
            source = ClosureSource(fn_value.source, i, name) if fn_value.source is not None else None
            cells[name] = RealCellValue(cell, source)
    for name in code.co_cellvars:
        cells.setdefault(name, CellValue())

    f_globals = fn_value.f_globals if nested else fn_value.fn.__globals__
    child = Translator(code, f_globals, tx.output, symbolic_locals, cells, parent=tx)
    if is_generator:  # its body runs a step at a time, as its consumer pulls
        from torchweld.capture.generators import GeneratorValue

        return GeneratorValue(child)
    if is_genexpr:
        child.yielded = []
        child.run()
        return IteratorValue(child.yielded)
    return child.run()
