"""Kernels whose sizes are arguments, where that saves Triton compiles.

The kernels of one network often differ only in the integers of their source: densenet121's
dense layers grow by 32 channels each, so its training step renders 504 distinct Triton kernels,
about 170 once their integers are ignored. Triton compiles every distinct source apart (~0.35 s of
a worker's CPU each on the H100 host). A kernel that differs from two earlier ones of its graph
only so is rendered with its integers as arguments (`ks0, ks1, ...`), one source for the rest
of its family, compiled once per specialization (Triton compiles apart an integer divisible by
16, and 1); the first two of a family, and a kernel no other resembles, keep their literals,
which cost the GPU nothing (`TritonRenderer.render_modules` decides as it renders, see
tuning.literal_family_members). densenet121's training step: forward 261 compiles to 123, backward
240 to 165.

Which integers become arguments: the element counts (masks, reduction loops), the sizes a
flat index unravels into, and the integer constants of index arithmetic and comparisons
(strides, offsets, a concatenation's bounds). An unravelling's divisions take their divisor's
magic number and shift (`magic_division`, Granlund and Montgomery's division by invariant
integers, one int64 argument): a fixed multiply-high and shift instead of a division
sequence. Timed on single 2M-element kernels on the H100 (`bench/investigations/divide_cost.py`),
literals, runtime `%` and magic numbers came out within the noise of such timings
(bench/DECISIONS.md#size-args). Divisors inside expressions (an upsampling's `// 2`) and the
operands of other operations stay literals.
"""
from __future__ import annotations

import dataclasses
import math

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Op
from torchweld.compiler.schedule import Kernel, map_exprs
from torchweld.compiler.symbols import is_symbol_size, size_key

# operations whose integer operands may be arguments: index arithmetic and comparisons
_PARAMETERIZED_IN = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE,
                               Op.MAXIMUM, Op.MINIMUM})
_INT32 = 1 << 31


def magic_division(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == umulhi(n, magic) >> shift for every 0 <= n < 2**31 and
    d >= 2: magic = ceil(2**(31 + L) / d) with L = ceil(log2 d), below 2**32."""
    log2 = (d - 1).bit_length()
    return -(-(1 << (31 + log2)) // d), log2 - 1


def packed_division(d: int) -> int:
    """d's magic number and shift as one int64 argument (`_tw_divide` unpacks it): magic in
    the low 32 bits, shift above. Never below 2**31 (d = 2 gives magic 2**31, shift 0), so
    Triton types it int64 whatever d is, and never 1, which Triton would make a constant."""
    magic, shift = magic_division(d)
    return magic | shift << 32


@dataclasses.dataclass
class SizeArgs:
    """A kernel's integers as arguments: `kernel` is the kernel as rendered (indices coalesced,
    branch loads masked) with its parameterized constants as variables named `ks<i>`;
    `names` maps each integer to its argument, `divisors` each unravelling divisor to the
    argument of its magic number and shift (packed_division)."""

    kernel: Kernel
    names: dict[object, str]  # symbols.size_key(integer) -> its argument
    divisors: dict[int, str]

    def params(self) -> tuple[str, ...]:
        return (*self.names.values(), *self.divisors.values())

    def symbolic_params(self) -> tuple[str, ...]:
        """The arguments whose values are symbolic sizes' expressions (computed at each call)."""
        return tuple(name for key, name in self.names.items() if isinstance(key, tuple))

    def name_of(self, value: object) -> str | None:
        """The argument taking the integer `value` (an int or a symbolic size), if one does."""
        return self.names.get(size_key(value))

    def values(self) -> tuple:
        """The arguments' values: ints, and where the graph's sizes are symbols, their
        expressions (sympy), which the wrapper computes at each call (symbols.size_text)."""
        return (*(k[1] if isinstance(k, tuple) else k for k in self.names), *map(packed_division, self.divisors))


def parameterized(prepared: Kernel) -> SizeArgs | None:
    """`prepared` (a kernel as the renderer sees it) with its integers as arguments, or None
    where it has none to take or one outside int32. Its indices must stay below 2**31 (the
    caller checks needs_int64): the divisions by magic number take 32-bit indices."""
    names: dict[int, str] = {}
    divisors: dict[int, str] = {}

    def divisor(value: int) -> None:
        divisors.setdefault(value, f"kd{len(divisors)}")

    for sizes in (prepared.outer, prepared.reduced):
        _name(names, math.prod(sizes))
        first = True
        for size, inner in zip(sizes, ir.inner_sizes(sizes)):
            if size == 1:
                continue
            if inner != 1:  # a symbolic divisor is a plain argument, divided by with `//`
                _name(names, inner) if is_symbol_size(inner) else divisor(inner)
            if not first:
                _name(names, size)
            first = False
    return _taking(prepared, names, divisors)


def with_loop_sizes(kernel: Kernel) -> SizeArgs | None:
    """`kernel` with its loops' sizes and its index arithmetic's integers as arguments, for a
    target whose loops run to bounds given at run time (C++: compiler/codegen/cpp.py), or None
    where it has none to take or one outside int32."""
    names: dict[int, str] = {}
    for size in (*kernel.outer, *kernel.reduced):
        _name(names, size)
    return _taking(kernel, names, {})


def _name(names: dict[object, str], value: int) -> str:
    if is_symbol_size(value):  # a symbolic size (never 0 or 1): always an argument
        return names.setdefault(size_key(value), f"ks{len(names)}")
    return names.setdefault(value, f"ks{len(names)}") if abs(value) >= 2 else str(value)


def _taking(kernel: Kernel, names: dict[int, str], divisors: dict[int, str]) -> SizeArgs | None:
    """`kernel` with the integer constants of its index arithmetic and comparisons named too,
    chosen (`choose`), as SizeArgs; None where it takes none or one outside int32."""
    memo: dict = {}

    def leaf(node: Expr):
        if not any(_takes(a) for a in node.args) or (
                node.op not in _PARAMETERIZED_IN and not any(map(ir.is_symbolic_const, node.args))):
            return None  # (a symbolic size is an argument in any operation: its value is not known here)
        args = tuple(ir.var(_name(names, a.arg)) if _takes(a) else a for a in node.args)
        return Expr(node.op, node.dtype, args, node.arg)

    taking = map_exprs(kernel, lambda e: ir.rewrite(e, leaf, memo), lambda e: ir.rewrite(e, leaf, memo))
    if any(not isinstance(v, tuple) and abs(v) >= _INT32 for v in names) or not (names or divisors):
        return None
    sizes = SizeArgs(taking, names, divisors)
    choose(taking, sizes)  # the kernel as rendered takes them: its kernel_params name them
    return sizes


def _takes(e: Expr) -> bool:
    if ir.is_symbolic_const(e):
        return e.dtype is ir.INDEX
    return e.op is Op.CONST and e.dtype is ir.INDEX and not isinstance(e.arg, bool) and abs(e.arg) >= 2


def chosen(kernel: Kernel) -> SizeArgs | None:
    """The size arguments `kernel` takes (`choose`), or None where its sizes are in its source."""
    return kernel.__dict__.get("_size_args")


def choose(kernel: Kernel, args: SizeArgs) -> None:
    """Make `kernel` take `args` (kernel_params and runtime_ints follow), kept in the (frozen)
    kernel's own __dict__, beside its fields."""
    kernel.__dict__["_size_args"] = args
