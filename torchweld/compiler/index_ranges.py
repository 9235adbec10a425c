"""Ranges of index expressions over loop bounds, and expressions simplified where those
ranges decide them.

A concatenation reads each input under a comparison of the loop variable with the
input's start, through an index clamped into that input (`rules.cat`); a pad compares
the variable with the pad's edges. Within a range of the variable that lies inside one
piece, every such comparison and clamp has one outcome: `breakpoints` finds where the
outcomes change, and `simplify` folds them for one range. The C++ renderer splits a
kernel's innermost loop at the breakpoints (a cat of three inputs becomes three plain
copy loops g++ vectorizes, not one loop of three clamped gathers and selects).
"""
from __future__ import annotations

import sympy

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Op
from torchweld.compiler.symbols import is_symbol_size, known

Range = tuple[int, int]  # inclusive bounds

_COMPARISONS = (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE)


def _is_index(e: Expr) -> bool:
    return e.dtype is ir.INDEX


def value_range(e: Expr, bounds: dict[str, Range], memo: dict | None = None) -> Range | None:
    """The inclusive range of index expression `e` when each variable lies in `bounds`;
    None where that is not known (a load, an unbounded variable, a division of negatives)."""
    memo = {} if memo is None else memo
    if id(e) in memo:
        return memo[id(e)][1]
    out = _range(e, bounds, memo)
    memo[id(e)] = (e, out)
    return out


def _range(e: Expr, bounds: dict[str, Range], memo: dict) -> Range | None:
    if not _is_index(e):
        return None
    if e.op is Op.CONST:
        return e.arg, e.arg
    if e.op is Op.VAR:
        return bounds.get(e.arg)
    args = [value_range(a, bounds, memo) for a in e.args]
    if any(a is None for a in args):
        return None
    if e.op is Op.ADD:
        (a, b), (c, d) = args
        return a + c, b + d
    if e.op is Op.MUL:
        (a, b), (c, d) = args
        products = (a * c, a * d, b * c, b * d)
        return min(products), max(products)
    if e.op is Op.NEG:
        ((a, b),) = args
        return -b, -a
    if e.op in (Op.MAXIMUM, Op.MINIMUM):
        (a, b), (c, d) = args
        pick = max if e.op is Op.MAXIMUM else min
        return pick(a, c), pick(b, d)
    if e.op in (Op.IDIV, Op.IMOD) and ir.is_const(e.args[1]) and e.args[1].arg > 0 and args[0][0] >= 0:
        (a, b), divisor = args[0], e.args[1].arg
        if e.op is Op.IDIV:
            return a // divisor, b // divisor
        return (a, b) if b < divisor and a // divisor == b // divisor else (0, divisor - 1)
    return None


def _decide(op: Op, a: Range, b: Range) -> bool | None:
    """Whether `x op y` holds for every x in `a` and y in `b` (True), for none (False), or None."""
    lo, hi = a[0] - b[1], a[1] - b[0]  # the range of x - y
    if is_symbol_size(lo) or is_symbol_size(hi):  # bounds over symbols: what their ranges prove, or None
        t = lambda relation: known(relation) is True  # noqa: E731
        zero = t(sympy.Eq(lo, 0)) and t(sympy.Eq(hi, 0))
        holds = {Op.LT: (t(hi < 0), t(lo >= 0)), Op.LE: (t(hi <= 0), t(lo > 0)), Op.GT: (t(lo > 0), t(hi <= 0)),
                 Op.GE: (t(lo >= 0), t(hi < 0)), Op.EQ: (zero, t(lo > 0) or t(hi < 0)),
                 Op.NE: (t(lo > 0) or t(hi < 0), zero)}[op]
    else:
        holds = {Op.LT: (hi < 0, lo >= 0), Op.LE: (hi <= 0, lo > 0), Op.GT: (lo > 0, hi <= 0),
                 Op.GE: (lo >= 0, hi < 0), Op.EQ: (lo == hi == 0, lo > 0 or hi < 0),
                 Op.NE: (lo > 0 or hi < 0, lo == hi == 0)}[op]
    if holds[0]:
        return True
    if holds[1]:
        return False
    return None


def simplify(e: Expr, bounds: dict[str, Range]) -> Expr:
    """`e` with the index comparisons, clamps (max/min) and selects that `bounds` decide
    folded away."""
    ranges: dict = {}

    def fold(node: Expr) -> Expr | None:
        args = node.args
        if node.op in _COMPARISONS and all(_is_index(a) for a in args):
            a, b = (value_range(x, bounds, ranges) for x in args)
            decided = None if a is None or b is None else _decide(node.op, a, b)
            return None if decided is None else ir.const(decided)
        if node.op in (Op.MAXIMUM, Op.MINIMUM) and _is_index(node):
            a, b = (value_range(x, bounds, ranges) for x in args)
            if a is None or b is None:
                return None
            if _decide(Op.GE, a, b):  # equal values: either is the answer
                return args[0] if node.op is Op.MAXIMUM else args[1]
            if _decide(Op.LE, a, b):
                return args[1] if node.op is Op.MAXIMUM else args[0]
            return None
        if node.op is Op.WHERE and ir.is_const(args[0]):
            return args[1] if args[0].arg else args[2]
        if node.op in (Op.LOGICAL_AND, Op.LOGICAL_OR):
            absorbing = node.op is Op.LOGICAL_OR  # True absorbs an or, False an and
            for x, other in (args, args[::-1]):
                if ir.is_const(x):
                    return x if bool(x.arg) == absorbing else other
        if node.op is Op.LOGICAL_NOT and ir.is_const(args[0]):
            return ir.const(not args[0].arg)
        return None

    return ir.rewrite(e, fold)


def breakpoints(exprs: list[Expr], name: str, size: int) -> list[int]:
    """The values of loop variable `name` (ranging over 0..size-1) at which some index
    comparison or clamp in `exprs` that depends on `name` alone changes its outcome,
    sorted; only those strictly inside the range."""
    points: set[int] = set()
    for e in exprs:
        for node in ir.walk(e):
            if not (node.op in _COMPARISONS or node.op in (Op.MAXIMUM, Op.MINIMUM)):
                continue
            if not all(_is_index(a) for a in node.args):
                continue
            a, b = (ir.affine_terms(x) for x in node.args)
            if a is None or b is None:
                continue
            coefs = {v: a[0].get(v, 0) - b[0].get(v, 0) for v in set(a[0]) | set(b[0])}
            coefs = {v: c for v, c in coefs.items() if c}
            if set(coefs) != {name} or abs(coefs[name]) != 1:
                continue
            k = a[1] - b[1]  # the difference is c * name + k, c = +-1
            # where c*v + k < 0 flips (<, >=, max, min), and where it is <= 0 flips (<=, >);
            # == and != flip at both
            strict = -k if coefs[name] == 1 else k + 1
            loose = -k + 1 if coefs[name] == 1 else k
            if node.op in (Op.LE, Op.GT):
                points.add(loose)
            elif node.op in (Op.EQ, Op.NE):
                points.update((min(strict, loose), max(strict, loose)))
            else:
                points.add(strict)
    return sorted(p for p in points if 0 < p < size)
