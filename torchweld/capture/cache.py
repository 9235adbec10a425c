"""The cache of one compiled code object: entries of (guard, transformed code),
each one generated Python function with the frame's own signature.

An entry is called with the frame's arguments. It evaluates its guards (through
the C guard evaluator, guard_program.py, or where that is off or cannot be built,
as one Python expression); on a miss it returns `MISS`, otherwise it runs the
compiled graph and rebuilds the frame's return value. A cache keeps its entries in
the order they were made.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import linecache
import sys
import types
from typing import Callable

import weakref

import torch

from torchweld import timing
from torchweld.capture.guard_program import compile_guards
from torchweld.capture.guards import GuardSet
from torchweld.capture.report import TranslationReport

MISS = object()

# Every live compiled function's cache, so that torchweld.reset() can empty them.
LIVE_CACHES: "weakref.WeakSet" = weakref.WeakSet()


@dataclasses.dataclass
class CacheEntry:
    run: Callable  # the generated entry: guards, then graph, then the return value
    check: Callable  # the guards alone, for recompile diagnosis
    guards: GuardSet
    report: TranslationReport
    source: str  # the generated entry's Python source (the `bytecode` log shows it)
    signature: str  # the frame's parameter list, for single-guard checks when diagnosing a miss
    namespace: dict  # the generated functions' globals
    alive: bool = True
    watchers: list = dataclasses.field(default_factory=list)
    # what the function's cache_size_limit counts versions by (CompiledFunction._limit_key)
    limit_key: tuple = ((), ())

    def release(self) -> None:
        """Called once the entry is dropped: break its FX graph's module-graph cycle, so that
        the user's layers the graph module holds are freed with the entry, not at the next
        cyclic garbage collection."""
        self.alive = False
        if self.report.graph is not None:
            self.report.graph.graph.owning_module = None

    def follow_defaults(self, fn: types.FunctionType) -> None:
        """Bind arguments with `fn`'s current defaults, as a call of `fn` does."""
        for f in (self.run, self.check):
            f.__defaults__, f.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__

    def failing_guard(self, args: tuple, kwargs: dict) -> str | None:
        """The readable text of the first guard these arguments fail, if any."""
        guard = self._first_failing(args, kwargs)
        return None if guard is None else guard.text

    def failed_guard_message(self, args: tuple, kwargs: dict) -> str | None:
        """The first guard these arguments fail, with what they hold instead, for the `recompiles`
        log and the cache-size-limit warning: `L['x'].shape == (4,) (got (8,))`."""
        guard = self._first_failing(args, kwargs)
        if guard is None:
            return None
        if guard.kind == "sizes":
            return self._failed_size_relation(guard, args, kwargs)
        if guard.source is None:
            read = guard.operands[0] if guard.kind == "call_is" else None
        else:
            read = self._with_defaults(_compile_reader(self.signature, guard.source.expr(), self.namespace))
        try:
            value = read(*args, **kwargs) if guard.source is not None else (read() if read else _UNREAD)
        except Exception as e:  # the source itself is gone: an attribute deleted, a key removed
            return f"{guard.text} (got {type(e).__name__}: {_short(str(e))})"
        return _failure_text(guard, value)

    def _failed_size_relation(self, guard, args: tuple, kwargs: dict) -> str:
        """The first relation of a symbolic-size guard these arguments break (the guard checks them
        all at once): `symbolic sizes: L['y'].size()[0] == s0 (got False, with s0 = 6)`."""
        binds, relations = guard.operands
        checks = [f"((___{b.symbol} := {b.read}) is not None)" for b in binds]
        for k, relation in enumerate(relations):
            check = " and ".join([*checks, *(f"({r.expr})" for r in relations[:k + 1])])
            if not self._with_defaults(_compile_check(self.signature, check, self.namespace))(*args, **kwargs):
                # (a check that raises is false: an input no longer a tensor)
                return f"symbolic sizes: {relation.readable} (got False, with {self._symbol_values(binds, args, kwargs)})"
        return guard.text

    def _symbol_values(self, binds: tuple, args: tuple, kwargs: dict) -> str:
        """`s0 = 6, s1 = 3`: each symbol as this call's sizes bind it."""
        if not binds:
            return "no symbol"
        read = self._with_defaults(_compile_reader(self.signature, f"({', '.join(b.read for b in binds)},)", self.namespace))
        try:
            values = read(*args, **kwargs)
        except Exception:
            return "sizes that cannot be read"
        return ", ".join(f"{b.symbol} = {value}" for b, value in zip(binds, values))

    def _first_failing(self, args: tuple, kwargs: dict):
        for guard in self.guards.all_guards:
            single = self._with_defaults(_compile_check(self.signature, guard.expr, self.namespace))
            if not single(*args, **kwargs):
                return guard
        return None

    def _with_defaults(self, f: Callable) -> Callable:
        f.__defaults__, f.__kwdefaults__ = self.run.__defaults__, self.run.__kwdefaults__
        return f


def signature_of(code: types.CodeType) -> tuple[str, str]:
    """(parameter list, call-through argument list) spelled like the code's own."""
    names = code.co_varnames
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    params: list[str] = []
    passes: list[str] = []
    for i, name in enumerate(names[:n_pos]):
        params.append(name)
        passes.append(name)
        if i + 1 == code.co_posonlyargcount:
            params.append("/")
    index = n_pos + n_kw
    if code.co_flags & inspect.CO_VARARGS:
        params.append(f"*{names[index]}")
        passes.append(f"*{names[index]}")
        index += 1
    elif n_kw:
        params.append("*")
    for name in names[n_pos:n_pos + n_kw]:
        params.append(name)
        passes.append(f"{name}={name}")
    if code.co_flags & inspect.CO_VARKEYWORDS:
        params.append(f"**{names[index]}")
        passes.append(f"**{names[index]}")
    return ", ".join(params), ", ".join(passes)


def parameter_names(code: types.CodeType) -> list[str]:
    """The frame's parameters as the function's body names them (`args` for `*args`)."""
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return list(code.co_varnames[:count])


def _guard_test(code: types.CodeType, guards: GuardSet, namespace: dict) -> str:
    """The entry's guard test as Python: a call of the C evaluator, put into `namespace`
    as `___guards`, or where there is none, the guards' own expression."""
    params = parameter_names(code)
    with timing.phase("guards"):
        evaluator = compile_guards(guards, params, namespace)
    if evaluator is None:
        return guards.expression()
    namespace["___guards"] = evaluator
    return f"___guards({', '.join(params)})"


def _compile_check(signature: str, guard_expr: str, namespace: dict) -> Callable:
    """`guard_expr` as a predicate with the frame's signature; an exception makes it false,
    as it makes the entry a miss."""
    source = (f"def ___check({signature}):\n    try:\n        return {guard_expr}\n"
              "    except Exception:\n        return False\n")
    exec(compile(source, "<torchweld guard>", "exec"), namespace)
    return namespace.pop("___check")


def _compile_reader(signature: str, expr: str, namespace: dict) -> Callable:
    """`expr` (a source's) as a function with the frame's signature that returns its value."""
    source = f"def ___read({signature}):\n    return {expr}\n"
    exec(compile(source, "<torchweld guard>", "exec"), namespace)
    return namespace.pop("___read")


_UNREAD = object()  # a guard whose value has no source to read again


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _named(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return f"<{name}>" if isinstance(name, str) else f"<{type(obj).__name__} object at {id(obj):#x}>"


def _failure_text(guard, value: object) -> str:
    """`guard`'s condition and, beside it, what `value` (its source's value now) is instead."""
    kind, ops = guard.kind, guard.operands
    name = guard.source.name() if guard.source is not None else ""
    if kind == "tensor":
        if type(value) is not ops[0]:
            return f"type({name}) is {ops[0].__name__} (got {type(value).__name__})"
        stride = tuple(value.stride()) if value.layout is torch.strided else None
        parts = (("dtype", ops[1], value.dtype), ("device", ops[2], value.device), ("shape", ops[3], tuple(value.shape)),
                 ("stride()", ops[4], stride), ("requires_grad", ops[5], value.requires_grad))
        for field, expected, actual in parts:
            if expected != actual and not (field == "stride()" and expected is None):
                return f"{name}.{field} == {expected!r} (got {actual!r})"
    elif kind == "held_tensor" and isinstance(value, torch.Tensor):
        for field, expected, actual in (("dtype", ops[0], value.dtype), ("get_device()", ops[1], value.get_device()),
                                        ("requires_grad", ops[2], value.requires_grad)):
            if expected != actual:
                return f"{name}.{field} == {expected!r} (got {actual!r})"
    elif kind in ("equals", "len", "type") and type(value) is not ops[0]:
        return f"{guard.text} (got {_short(type(value).__qualname__)})"
    elif kind == "len":
        return f"{guard.text} (got len {len(value)})"
    elif kind == "id":
        return f"{guard.text} (got {_named(value)})"
    elif kind == "dict_keys":
        return f"{guard.text} (got {_short(repr(list(value)) if isinstance(value, dict) else type(value).__qualname__)})"
    elif kind == "lacks":
        return f"{guard.text} (got {ops[0]!r} present)"
    elif kind == "instance_dict":
        own = vars(value) if hasattr(value, "__dict__") else {}
        found = [n for n in ops[0] if own.get(n)] + [n for n in ops[1] if n in own]
        return f"{guard.text} (got {', '.join(found) or 'a hook registered'})"
    elif kind == "hasattr":
        return guard.text
    if value is _UNREAD:
        return guard.text
    return f"{guard.text} (got {_value_text(value)})"


def _value_text(value: object) -> str:
    """A short description of `value` (no tensor data, no module tree)."""
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__}(dtype={value.dtype}, shape={tuple(value.shape)})"
    if isinstance(value, torch.nn.Module):
        return _named(value)
    try:
        return _short(repr(value))
    except Exception:  # a repr that raises
        return _named(value)


@dataclasses.dataclass(frozen=True)
class UserLine:
    """A statement of an entry that runs the user's own code natively (the instruction at a
    graph break): a traceback through it names the user's file and line, as eager's would."""

    text: str
    lineno: int


def build_entry(fn: types.FunctionType, guards: GuardSet, body: list[str | UserLine], constants: dict[str, object],
                report: TranslationReport) -> CacheEntry:
    """Generate the entry function: `body` runs once the guards hold. The entry's code carries
    the user's file name, its UserLine statements their lines, every other statement the line
    of the function's `def`: an error a break's native code raises points at the user's line."""
    signature, _ = signature_of(fn.__code__)
    namespace = {
        "___G": fn.__globals__, "___B": vars(builtins), "___closure": fn.__closure__,
        "___modules": sys.modules, "___MISS": MISS, **guards.constants, **constants,
    }
    guard_test = _guard_test(fn.__code__, guards, namespace)
    lines = [
        f"def ___entry({signature}):",
        "    try:",
        f"        if not ({guard_test}):",
        "            return ___MISS",
        "    except Exception:",
        "        return ___MISS",
        *(f"    {getattr(line, 'text', line)}" for line in body),
    ]
    source = "\n".join(lines) + "\n"
    first_body_line = len(lines) - len(body) + 1
    user_lines = {first_body_line + i: line.lineno for i, line in enumerate(body) if isinstance(line, UserLine)}
    exec(_compile_at_user_lines(source, fn.__code__, user_lines), namespace)
    run = namespace.pop("___entry")
    run.__code__ = run.__code__.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)
    # a call with the wrong arguments raises the TypeError eager raises: "f() takes 1 positional argument..."
    run.__name__, run.__qualname__ = fn.__name__, fn.__qualname__
    check = _compile_check(signature, guard_test, namespace)
    for f in (run, check):
        f.__defaults__ = fn.__defaults__
        f.__kwdefaults__ = fn.__kwdefaults__
    return CacheEntry(run, check, guards, report, source, signature, namespace)


def _compile_at_user_lines(source: str, code: types.CodeType, user_lines: dict[int, int]) -> types.CodeType:
    """`source` compiled as part of `code`'s file: line `n` of it at `user_lines[n]` (the
    whole line, so a traceback underlines nothing), any other at the function's first line."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) is None:
            continue
        lineno = user_lines.get(node.lineno)
        if lineno is None:
            node.lineno = node.end_lineno = code.co_firstlineno
            node.col_offset = node.end_col_offset = 0
            continue
        text = linecache.getline(code.co_filename, lineno)
        node.lineno = node.end_lineno = lineno
        node.col_offset, node.end_col_offset = len(text) - len(text.lstrip()), len(text.rstrip())
    return compile(tree, code.co_filename, "exec")
