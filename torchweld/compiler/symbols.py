"""Sizes that are symbols: a graph weld compiles once for every size (backends/weld_symbolic.py).

Such a graph's fake tensors have torch.SymInt sizes of a ShapeEnv of weld's own; the trace,
the lowering and the schedule compute with them as with ints, and the ShapeEnv records as a
guard whatever they decide from one. Code generation needs three things of a size that may
be a symbol: a key to name it by (a SymInt is unhashable: `size_key`, `same_sizes`), its text
in the wrapper's Python (computed from the symbols at each call: `size_text`), and where the
wrapper reads each symbol from (`symbols_read`). Kernels never spell a symbol: they take such
sizes as arguments (codegen/size_args.py). Code that holds a size as a sympy expression asks
the ShapeEnv of the compile running in its thread (`compiling_over`): `decide` (an answer the
result rests on, guarded), `known` (what the ranges prove, no guard), `hint` (the compiled
call's value, for choices any answer makes right), `fake_mode` (ops on symbolic fakes),
`compile_memo` and `compile_kept` (answers kept for the rest of the compile).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, TypeVar

import sympy
import torch
from torch.utils._sympy.printers import PythonPrinter

T = TypeVar("T")


def is_symbol_size(n: object) -> bool:
    """Whether `n` is a symbolic size: a SymInt, a sympy expression that is not a number, or
    the Python text of one (`SizeText`)."""
    return isinstance(n, (torch.SymInt, SizeText)) or isinstance(n, sympy.Expr) and not n.is_number


class SizeText(str):
    """A size the wrapper computes, held as its Python (`size_text` renders it as itself, and it
    is no launch constant: `!= 1`): one loaded from the graph cache, or a launch's grid over
    symbols (written, not asked of sympy, whose floor division of a product by a block
    simplified it: 0.2 s of GPT-2's compile over symbols, with sympy.simplify's first import)."""

    def __repr__(self) -> str:
        return str(self)


def size_key(n: object) -> object:
    """A hashable key for the size `n`: `n` itself, or ("sym", a symbolic size's expression)."""
    if isinstance(n, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", n.node.expr)
    return ("sym", n) if isinstance(n, sympy.Expr) and not n.is_number else n


def sizes_key(value: object) -> object:
    """A hashable key for `value`, sizes among ints, lists, tuples and dicts (`size_key` each)."""
    if isinstance(value, (list, tuple)):
        return tuple(map(sizes_key, value))
    if isinstance(value, dict):
        return tuple((k, sizes_key(v)) for k, v in value.items())
    return size_key(value)


def same_sizes(a: tuple, b: tuple) -> bool:
    """Whether two tuples of sizes are equal for every value of their symbols: the same
    expressions (no guard; sizes that differ only at some values count as different, so that
    a decision taken on it, such as a fusion, is right at every size)."""
    return len(a) == len(b) and all(size_key(x) == size_key(y) for x, y in zip(a, b))


def size_text(n: object) -> str:
    """Python for the size `n` (an int, a SymInt or its sympy expression; a SymFloat or SymBool
    computed from sizes too) in a wrapper that binds each symbol of the graph's input sizes to
    a local of its name (`symbols_read`), and `torch` (which `torch.sym_float(s0)` reads)."""
    if isinstance(n, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        n = n.node.expr
    if isinstance(n, sympy.Basic):
        return f"({PythonPrinter().doprint(n)})"
    return repr(n)


def sizes_text(sizes) -> str:
    """A tuple of sizes as Python (`size_text` each)."""
    parts = [size_text(n) for n in sizes]
    return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"


_compiling = threading.local()  # .env: the ShapeEnv of the graph this thread compiles over symbols


@contextlib.contextmanager
def compiling_over(env) -> object:
    """While a graph over the symbols of ShapeEnv `env` compiles in this thread (`decide`). Its
    aten graphs take symbolic sizes as node arguments, as SymInts (what weld's lowering reads),
    of which torch.fx warns at every node made or copied: not shown."""
    previous = compiling_env(), getattr(_compiling, "memos", None)
    _compiling.env, _compiling.memos = env, {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Raw Sym")
            yield env
    finally:
        _compiling.env, _compiling.memos = previous


def compiling_env():
    """The ShapeEnv of the graph this thread compiles over symbols; None outside such a compile."""
    return getattr(_compiling, "env", None)


def compile_memo(name: str) -> dict | None:
    """A dict named `name` that lives as long as the compile over symbols running in this thread
    (None outside one): for results that depend only on their key within one ShapeEnv, whose
    first computation recorded the guards they rest on (a view's layout, a decided relation):
    the twelve layers of a GPT-2 ask each such question twelve times, at ~1 ms a sympy answer."""
    memos = getattr(_compiling, "memos", None)
    return None if memos is None else memos.setdefault(name, {})


def compile_kept(name: str, key: object, compute: Callable[[], T]) -> T:
    """`compute()`, computed once per `key` (sizes in it by their expressions: `sizes_key`) in
    the compile over symbols running in this thread (`compile_memo(name)`), each time outside one."""
    memo = compile_memo(name)
    if memo is None:
        return compute()
    key = sizes_key(key)
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def symbol_values(env) -> dict:
    """{symbol: its value at the call being compiled} of ShapeEnv `env` (torch 2.13 renamed it)."""
    return env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val


def fake_mode():
    """A FakeTensorMode over the ShapeEnv of the graph this thread compiles over symbols, for
    running an op on tensors of symbolic sizes (lowering's view layouts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchweld.fake_tensors import over_symbols

    env = compiling_env()
    if env is None:
        raise NotImplementedError("a tensor of symbolic sizes outside a symbolic compile")
    return over_symbols(FakeTensorMode(allow_non_fake_inputs=True), env)


def decide(relation: object) -> bool:
    """A comparison of sizes (a Python bool, or a sympy relation over the symbols of the graph
    compiling in this thread), answered as at the call being compiled, and recorded as a guard
    of its compile unless the symbols' ranges prove it."""
    if isinstance(relation, bool):
        return relation
    if isinstance(relation, sympy.Basic) and relation.is_Boolean and relation in (sympy.true, sympy.false):
        return bool(relation)
    env = compiling_env()
    if env is None:
        raise NotImplementedError(f"a comparison of symbolic sizes ({relation}) outside a symbolic compile")
    decided = compile_memo("decided")  # (a relation asked again, by a layer's twin: its guard is there)
    if relation not in decided:
        decided[relation] = bool(env.evaluate_expr(relation))
    return decided[relation]


def known(relation: object) -> bool | None:
    """A comparison of sizes where the symbols' ranges decide it (no guard recorded), else None."""
    if isinstance(relation, bool):
        return relation
    if isinstance(relation, torch.SymBool):
        relation = relation.node.expr
    if relation in (sympy.true, sympy.false):
        return bool(relation)
    env = compiling_env()
    found = env._maybe_evaluate_static(relation) if env is not None else None
    return None if found is None else bool(found)


def hint(n: object) -> int:
    """The value of the size `n` at the call being compiled: for choices that any value would
    make correct (block sizes), never for what the code's correctness rests on (`decide`)."""
    if isinstance(n, torch.SymInt):
        return n.node.hint
    if isinstance(n, sympy.Expr) and not n.is_number:
        return int(compiling_env().size_hint(n))
    return int(n)


def sympy_size(n: object) -> object:
    """A size as a sympy expression (an int stays an int)."""
    return n.node.expr if isinstance(n, torch.SymInt) else n


def symbols_read(inputs: list[tuple[str, tuple]]) -> dict[str, str]:
    """{symbol's name: Python reading it} from `inputs`, (name, shape) pairs of the graph's
    tensor inputs: each symbol from the first dim whose size is that symbol alone."""
    reads: dict[str, str] = {}
    for name, shape in inputs:
        for d, n in enumerate(shape):
            if isinstance(n, torch.SymInt):
                expr = n.node.expr
                if isinstance(expr, sympy.Symbol) and expr.name not in reads:
                    reads[expr.name] = f"{name}.size({d})"
    return reads
