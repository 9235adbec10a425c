"""Symbolic sizes of one capture: fake inputs whose chosen dims are symbols of a torch
ShapeEnv, and the guard that checks, at each call, what the ShapeEnv learned about them.

Which dims are symbolic is decided by `dynamic_dims.DimChoices` (the modes and marks);
this module only makes the symbols and reads them back. A dim of size 0 or 1 stays a
number (ShapeEnv specializes them, as under torch.compile), and every symbol is
assumed >= 2, which the guard checks.

The guard (`SizeGuard`) binds each symbol to the first size that made it (`Bind`), then
checks relations (`Relation`): every other size and stride compared with its expression,
then the ShapeEnv's ranges and the guards recorded where capture branched on a size
(`if x.shape[0] > 4`). Each part is Python text (the guard's expression, which the
Python evaluator runs) and says what it reads, so that guard_program.py can lay the
guard out for the C evaluator: sizes read into int64 slots, each relation a small
postfix program over them (a relation it cannot spell, one over floats, stays Python).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, NamedTuple

import sympy
import torch
from torch._guards import GuardSource, SLoc, Source as TorchSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, free_symbols
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

from torchweld.capture.sources import Source

SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclasses.dataclass(frozen=True)
class SizeSource(TorchSource):
    """Where a ShapeEnv symbol was read: `L['x'].size()[0]`; what ShapeEnv names in its messages."""

    tensor: str
    dim: int

    @property
    def name(self) -> str:  # ShapeEnv reads `source.name` as an attribute
        return f"{self.tensor}.size()[{self.dim}]"

    @property
    def guard_source(self) -> GuardSource:
        return GuardSource.LOCAL


@dataclasses.dataclass(frozen=True)
class IntSource(TorchSource):
    """Where the symbol of an int argument was read: `L['n']`."""

    expr_name: str

    @property
    def name(self) -> str:
        return self.expr_name

    @property
    def guard_source(self) -> GuardSource:
        return GuardSource.LOCAL


class CaptureShapeEnv(ShapeEnv):
    """A ShapeEnv that places what it records at the user's line capture is at, instead of
    walking the Python stack (torch's walk imports its own compiler's modules to know
    which files to skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.user_location: Callable[[], str] = lambda: "<capture>"

    def _get_stack_summary(self, is_debug: bool = False, framework_loc: str | None = None) -> tuple[SLoc, str]:
        return SLoc(framework_loc=framework_loc or "torchweld capture", maybe_user_loc=self.user_location()), ""


@dataclasses.dataclass
class SymbolicInput:
    """A tensor input with at least one symbolic dim, or an int input read as a symbol (`fake`
    its SymInt)."""

    source: Source
    fake: torch.Tensor | torch.SymInt
    marked: set[int]  # dims the user marked with mark_dynamic: an error if capture specializes them

    def symbols(self) -> list[tuple[object, str, Callable[[str], str], int | None]]:
        """(symbolic size, readable name, how Python reads it from the input's expression, the dim
        it is the size of, None for an int input, itself the size) of each symbolic size this input brings."""
        if isinstance(self.fake, torch.SymInt):
            return [(self.fake, self.source.name(), lambda e: e, None)]
        return [(n, f"{self.source.name()}.size()[{d}]", lambda e, d=d: f"{e}.size({d})", d)
                for d, n in enumerate(self.fake.shape) if isinstance(n, torch.SymInt)]


class Bind(NamedTuple):
    """A symbol bound to the size it was made from: `(___s0 := read) is not None` in Python."""

    symbol: str  # "s0"
    readable: str  # "L['x'].size()[0]"
    read: str  # Python reading it: "x.size(0)", or an int input's own expression
    source: Source  # the input read
    dim: int | None  # the dim whose size it is; None: an int input, whose value it is


class Relation(NamedTuple):
    """A relation between sizes, readable and as Python over the inputs and the bound symbols
    (`___s0`). `kind` says what it reads: "size": `source.size(dim) == terms[0]` (dim None: the
    int input itself); "stride": `source.stride() == terms`; "holds": `expr` reads symbols only."""

    readable: str
    expr: str
    kind: str = "holds"
    source: Source | None = None
    dim: int | None = None
    terms: tuple[str, ...] = ()


def is_symbolic(value: object) -> bool:
    return isinstance(value, SYMBOLIC_TYPES)


def hint(n: object) -> object:
    """The size at capture of `n` (an int or a SymInt), read without adding a guard."""
    if isinstance(n, SYMBOLIC_TYPES):
        return n.node.hint
    return n


def dense_order(real: torch.Tensor) -> list[int] | None:
    """The dims of `real` innermost first, if its strides are those of a dense tensor laid out
    in that order (contiguous, channels-last, transposed); None for gaps, overlaps, offsets."""
    if real.layout is not torch.strided or real.storage_offset() != 0:
        return None
    order = sorted(range(real.dim()), key=lambda d: (real.stride(d), -d))
    expected = 1
    for d in order:
        if real.stride(d) != expected:
            return None
        expected *= real.shape[d]
    return order


def symbolic_fake(mode, env: ShapeEnv, real: torch.Tensor, source: Source, dynamic: dict[int, tuple[str, bool, int | None,
                  int | None]]) -> torch.Tensor | None:
    """A fake of `real` whose dims in `dynamic` (dim -> (why, exact, min, max)) are symbols of `env`;
    None where its layout cannot be described with symbolic strides (capture keeps it static)."""
    order = dense_order(real)
    if order is None:
        return None
    sizes: list = []
    for d, n in enumerate(real.shape):
        if d not in dynamic:
            sizes.append(n)
            continue
        _, exact, low, high = dynamic[d]
        where = SizeSource(source.name(), d)
        symbol = env.create_symbol(n, where, dynamic_dim=DimDynamic.DYNAMIC if exact else DimDynamic.DUCK)
        if isinstance(symbol, sympy.Symbol) and (low is not None or high is not None):
            current = env.var_to_range[symbol]
            lower = max(int(current.lower), low) if low is not None else current.lower
            upper = min(current.upper, high) if high is not None else current.upper
            env.constrain_symbol_range(symbol, compiler_min=lower, compiler_max=upper)
        sizes.append(env.create_symintnode(symbol, hint=n, source=where))
    strides: list = [0] * real.dim()
    running = 1
    for d in order:
        strides[d] = running
        running = running * sizes[d]
    with mode:
        fake = torch.empty_strided(sizes, strides, dtype=real.dtype, device=real.device)
    if real.requires_grad:
        fake.requires_grad_(True)
    return fake


# gm.meta key capture sets on a graph with symbolic sizes: its guards fix every size of its
# inputs that is not a symbol, so the symbols' values alone tell a call's sizes (weld_sizes.py)
SIZES_GUARDED = "torchweld_sizes_guarded"


class SizeGuard:
    """What one graph assumed of its symbolic sizes: the symbols' bindings and the relations (`parts`)."""

    def __init__(self, env: ShapeEnv, inputs: list[SymbolicInput]):
        self.env = env
        self.inputs = inputs

    def _spell(self, expr, module: Callable[[object], str]) -> str:
        expr = self.env.replace(sympy.sympify(expr))
        return python_text(expr, {s: sympy.Symbol(f"___{s.name}", integer=True) for s in expr.free_symbols}, module)

    def parts(self, module: Callable[[object], str]) -> tuple[list[Bind], list[Relation]]:
        """The symbols' bindings and the relations, in the order they are checked; the modules the
        expressions call (`torch.sym_float`, `math.floor`) read as `module(m)` names."""
        env = self.env
        bound: set = set()
        binds: list[Bind] = []
        relations: list[Relation] = []
        for item in self.inputs:
            e = item.source.expr()
            for size, readable, read, dim in item.symbols():
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and env.replace(expr) == expr and expr not in bound:
                    bound.add(expr)
                    binds.append(Bind(str(expr), readable, read(e), item.source, dim))
                    continue
                term = self._spell(expr, module)
                relations.append(Relation(f"{readable} == {env.replace(expr)}", f"{read(e)} == {term}", "size",
                                          item.source, dim, (term,)))
            if not isinstance(item.fake, torch.Tensor):
                continue
            strides = tuple(self._spell(s.node.expr, module) if isinstance(s, torch.SymInt) else repr(s)
                            for s in item.fake.stride())
            relations.append(Relation(f"{item.source.name()}.stride() == ({', '.join(map(str, item.fake.stride()))})",
                                      f"{e}.stride() == ({', '.join(strides)}{',' if len(strides) == 1 else ''})",
                                      "stride", item.source, None, strides))
        for symbol in sorted(bound, key=str):
            r = env.var_to_range.get(symbol)
            if r is None:
                continue
            name = f"___{symbol.name}"
            if r.lower not in (-int_oo,) and r.lower is not None:
                relations.append(Relation(f"{symbol} >= {r.lower}", f"{name} >= {int(r.lower)}"))
            if r.upper not in (int_oo,) and r.upper is not None:
                relations.append(Relation(f"{symbol} <= {r.upper}", f"{name} <= {int(r.upper)}"))
        for g in env.guards:
            expr = env.simplify(g.expr)
            if expr == sympy.true:
                continue
            relations.append(Relation(str(expr), self._spell(expr, module)))
        return binds, relations


def specialized_marks(env: ShapeEnv, inputs: list[SymbolicInput]) -> None:
    """Raise where a dim the user marked dynamic was made a number by capture (`if x.shape[0] == 8`,
    `range(x.shape[0])`), naming the line where it happened."""
    from torchweld.errors import DynamicDimSpecialized

    for item in inputs:
        for d in sorted(item.marked):  # (an int input has no marks)
            symbol = env.source_to_var.get(SizeSource(item.source.name(), d).name)  # as made, before replacements
            if symbol is None:
                continue
            value = env.replace(symbol)
            if value.free_symbols:
                continue
            sloc = getattr(env, "replacements_slocs", {}).get(symbol)
            where = getattr(sloc, "maybe_user_loc", None) or "a line of the captured code"
            raise DynamicDimSpecialized(f"{item.source.name()}.size()[{d}] was marked dynamic (mark_dynamic), but capture had to "
                            f"specialize it to {value} at {where}. Remove the mark, or rewrite that line so that it "
                            "does not need the exact size (a Python branch or loop on it)")


_PRINTED_MODULES = {"torch": torch, "math": math}


def python_text(expr, rename: dict, module: Callable[[object], str]) -> str:
    """`expr` as Python, its symbols renamed by `rename`; the functions the printer calls
    (`torch.sym_float`, `math.floor`, `math.inf`) read through `module(torch)`, `module(math)`:
    names the generated code's namespace holds (it has no `torch` or `math` of its own)."""
    text = PythonPrinter().doprint(expr.xreplace(rename))
    return re.sub(r"\b(torch|math)\.", lambda m: f"{module(_PRINTED_MODULES[m.group(1)])}.", text)


def spell_over_inputs(env: ShapeEnv, inputs: list[SymbolicInput], sym: object, read: Callable[[Source], str],
                      module: Callable[[object], str]) -> str | None:
    """Python that computes `sym` (a SymInt or SymFloat) from the inputs' sizes at run time, each
    input spelled by `read(source)`, modules by `module` (python_text); None where a symbol in it
    comes from no input size."""
    expr = env.replace(sym.node.expr)
    names: dict = {}
    reads: dict[str, str] = {}
    for symbol in expr.free_symbols:
        found = next(((item.source, how) for item in inputs for n, _, how, _ in item.symbols()
                      if n.node.expr == symbol), None)
        if found is None:
            return None
        placeholder = f"___size{len(names)}___"
        names[symbol] = sympy.Symbol(placeholder, integer=True)
        reads[placeholder] = found[1](read(found[0]))
    text = python_text(expr, names, module)
    for placeholder, spelled in reads.items():
        text = text.replace(placeholder, spelled)
    return f"({text})"
