"""The loop IR: what every aten op becomes, with no target's strings in it.

A value is an `Expr` tree computed at one index of an iteration space: leaves
are constants, index variables and loads from named buffers; inner nodes apply
an `Op`. Every lowered aten op is one of four things:

    Pointwise   shape, body: Expr over the index variables d0..dN-1
    Reduction   a Pointwise body over a full shape, combined over `reduced` dims
    View        index arithmetic on another buffer (no copy; lives in lowering)
    Extern      a call to the aten kernel itself (matmul, convolution, anything
                without a lowering)

Index variables in a body are `Expr(Op.VAR, arg="d<i>")`; a reader substitutes
its own index for them (`substitute`). Renderers (codegen/) turn Exprs into
C++ or Triton through their `code_for_op` tables; passes query the op sets at
the bottom instead of listing ops again.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, Iterable

import sympy
import torch
from torch.utils._sympy.functions import ToFloat

from torchweld.compiler.symbols import hint, size_key
from torchweld.tuning import tuning


class Op(enum.Enum):
    # -- leaves ------------------------------------------------------------------
    CONST = enum.auto()  # arg: a Python bool/int/float
    VAR = enum.auto()  # arg: an index variable's name ("d0", or a kernel's loop variable)
    LOAD = enum.auto()  # arg: buffer name; args: one index Expr per buffer dim
    REDUCED = enum.auto()  # arg: name of a reduction computed earlier in the same kernel
    # arg: buffer name; args: (flat index, bool mask); 0 where the mask is false, and no memory
    # read there. Made by the Triton renderer only, from the branches of a WHERE
    MASKED_LOAD = enum.auto()
    # -- index arithmetic (non-negative int64 operands) --------------------------
    IDIV = enum.auto()
    IMOD = enum.auto()
    # -- unary -------------------------------------------------------------------
    NEG = enum.auto()
    ABS = enum.auto()
    EXP = enum.auto()
    EXPM1 = enum.auto()
    LOG = enum.auto()
    LOG1P = enum.auto()
    LOG2 = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    TANH = enum.auto()
    ATAN = enum.auto()
    SQRT = enum.auto()
    RSQRT = enum.auto()
    RECIPROCAL = enum.auto()
    SIGMOID = enum.auto()
    ERF = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    TRUNC = enum.auto()
    ROUND = enum.auto()
    SIGN = enum.auto()
    ISNAN = enum.auto()
    LOGICAL_NOT = enum.auto()
    BITWISE_NOT = enum.auto()
    # -- binary ------------------------------------------------------------------
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    TRUEDIV = enum.auto()
    FLOORDIV = enum.auto()  # Python semantics (rounds toward -inf), ints and floats
    REMAINDER = enum.auto()  # Python semantics (sign of the divisor)
    POW = enum.auto()
    MAXIMUM = enum.auto()  # NaN-propagating, like torch.maximum
    MINIMUM = enum.auto()
    ATAN2 = enum.auto()
    LT = enum.auto()
    LE = enum.auto()
    GT = enum.auto()
    GE = enum.auto()
    EQ = enum.auto()
    NE = enum.auto()
    LOGICAL_AND = enum.auto()
    LOGICAL_OR = enum.auto()
    LOGICAL_XOR = enum.auto()
    BITWISE_AND = enum.auto()
    BITWISE_OR = enum.auto()
    BITWISE_XOR = enum.auto()
    # -- ternary -----------------------------------------------------------------
    WHERE = enum.auto()
    # args: (a, b, c): a * b + c rounded once, as aten's fused kernels compute add's alpha, lerp
    # and addcmul (Vectorized fmadd). C++ kernels contract nothing else (-ffp-contract=off)
    FMA = enum.auto()
    # -- conversion --------------------------------------------------------------
    CAST = enum.auto()  # dtype: the target dtype
    # -- random numbers ----------------------------------------------------------
    # args: (seed, offset): a float32 uniform in [0, 1), a pure function of an int64 seed and a
    # non-negative offset below 2**31 (a counter-based generator, Philox), so that every kernel
    # that computes it at one offset gets the same number
    RAND = enum.auto()
    # -- reductions (a Reduction's `reduce_op`, never inside an Expr) ------------
    SUM = enum.auto()
    PROD = enum.auto()
    MAX = enum.auto()
    MIN = enum.auto()


class OpSet:
    """Named groups of ops that passes and renderers query."""

    Leaf = frozenset({Op.CONST, Op.VAR, Op.LOAD, Op.REDUCED})
    Index = frozenset({Op.IDIV, Op.IMOD})
    Unary = frozenset({
        Op.NEG, Op.ABS, Op.EXP, Op.EXPM1, Op.LOG, Op.LOG1P, Op.LOG2, Op.SIN, Op.COS, Op.TAN,
        Op.TANH, Op.ATAN, Op.SQRT, Op.RSQRT, Op.RECIPROCAL, Op.SIGMOID, Op.ERF, Op.FLOOR,
        Op.CEIL, Op.TRUNC, Op.ROUND, Op.SIGN, Op.ISNAN, Op.LOGICAL_NOT, Op.BITWISE_NOT,
    })
    Binary = frozenset({
        Op.ADD, Op.SUB, Op.MUL, Op.TRUEDIV, Op.FLOORDIV, Op.REMAINDER, Op.POW, Op.MAXIMUM,
        Op.MINIMUM, Op.ATAN2, Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE, Op.LOGICAL_AND,
        Op.LOGICAL_OR, Op.LOGICAL_XOR, Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR,
    })
    Comparison = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE, Op.ISNAN})
    Logical = frozenset({Op.LOGICAL_AND, Op.LOGICAL_OR, Op.LOGICAL_XOR, Op.LOGICAL_NOT})
    Transcendental = frozenset({
        Op.EXP, Op.EXPM1, Op.LOG, Op.LOG1P, Op.LOG2, Op.SIN, Op.COS, Op.TAN, Op.TANH, Op.ATAN,
        Op.SQRT, Op.RSQRT, Op.SIGMOID, Op.ERF, Op.POW, Op.ATAN2,
    })
    # functions of many instructions each (libdevice's and libm's sin, exp, pow...), not one
    # hardware instruction (sqrt, rsqrt)
    Costly = frozenset({
        Op.EXP, Op.EXPM1, Op.LOG, Op.LOG1P, Op.LOG2, Op.SIN, Op.COS, Op.TAN, Op.TANH, Op.ATAN,
        Op.SIGMOID, Op.ERF, Op.POW, Op.ATAN2,
    })
    Elementwise = Unary | Binary | {Op.WHERE, Op.FMA, Op.CAST}
    Reduce = frozenset({Op.SUM, Op.PROD, Op.MAX, Op.MIN})


# =============================================================================
# Expressions
# =============================================================================


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Expr:
    """One value at one index. Trees share subtrees; renderers CSE them."""

    op: Op
    dtype: torch.dtype
    args: tuple["Expr", ...] = ()
    arg: object = None
    _key: tuple | None = dataclasses.field(default=None, init=False, repr=False)  # key(), once computed
    _loads: tuple | None = dataclasses.field(default=None, init=False, repr=False)  # loads(), once computed
    _variables: frozenset | None = dataclasses.field(default=None, init=False, repr=False)  # variables()

    def __repr__(self) -> str:
        if self.op is Op.CONST or self.op is Op.VAR:
            return str(self.arg)
        inner = ", ".join(map(repr, self.args))
        label = self.op.name if self.arg is None else f"{self.op.name}[{self.arg}]"
        return f"{label}({inner})"

    def key(self) -> tuple:
        """A structural key: equal keys compute the same value."""
        key = self._key
        if key is None:
            key = (self.op, self.dtype, self.arg, tuple(a.key() for a in self.args))
            object.__setattr__(self, "_key", key)
        return key


INDEX = torch.int64


def const(value: object, dtype: torch.dtype | None = None) -> Expr:
    """A constant; a symbolic size (a SymInt, or its sympy expression) is an INDEX constant whose
    `arg` is its expression, which kernels take as an argument (codegen/size_args.py), cast to
    `dtype` where that is another (a mean's count: float(n), as eager converts it)."""
    if isinstance(value, torch.SymFloat):
        value = value.node.expr
        if not value.is_number:
            if value.func is not ToFloat:
                raise NotImplementedError(f"a float computed from symbolic sizes ({value}) in a kernel")
            value = value.args[0]
            dtype = torch.float32 if dtype is None else dtype
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if isinstance(value, sympy.Expr):
        if not value.is_number:
            index = Expr(Op.CONST, INDEX, (), value)
            return index if dtype is None or dtype is INDEX else Expr(Op.CAST, dtype, (index,))
        value = int(value) if value.is_integer else float(value)
    if dtype is None:
        dtype = torch.bool if isinstance(value, bool) else INDEX if isinstance(value, int) else torch.float32
    if dtype.is_floating_point:
        value = float(value)
    elif dtype is torch.bool:
        value = bool(value)
    else:
        value = int(value)
    return Expr(Op.CONST, dtype, (), value)


def var(name: str) -> Expr:
    return Expr(Op.VAR, INDEX, (), name)


def dim_vars(ndim: int) -> list[Expr]:
    """The placeholder index d0..dN-1 a node's body is written over."""
    return [var(f"d{i}") for i in range(ndim)]


def load(buffer: str, dtype: torch.dtype, index: Iterable[Expr]) -> Expr:
    return Expr(Op.LOAD, dtype, tuple(index), buffer)


def is_const(e: Expr, value: object = None) -> bool:
    return e.op is Op.CONST and (value is None or e.arg == value)


# -- operations a kernel must not run ------------------------------------------


def trapping_division(e: Expr) -> Expr | None:
    """The first integer FLOORDIV or REMAINDER node of `e` whose divisor is not a constant
    other than 0 and -1, or None. A CPU's integer division traps on x / 0 and on
    INT64_MIN / -1 (SIGFPE takes the whole process down); aten raises ZeroDivisionError for
    the first and wraps the second, so such a division runs as aten's, never in a kernel."""
    for node in walk(e):
        if node.op in (Op.FLOORDIV, Op.REMAINDER) and not node.dtype.is_floating_point \
                and node.dtype is not torch.bool:
            divisor = node.args[1]
            if not (divisor.op is Op.CONST and divisor.arg not in (0, -1)):
                return node
    return None


# -- index arithmetic, folded as it is built ----------------------------------


def iadd(a: Expr, b: Expr) -> Expr:
    if is_const(a) and is_const(b):
        return const(a.arg + b.arg)
    if is_const(a, 0):
        return b
    if is_const(b, 0):
        return a
    return Expr(Op.ADD, INDEX, (a, b))


def imul(a: Expr, b: Expr) -> Expr:
    if is_const(a) and is_const(b):
        return const(a.arg * b.arg)
    if is_const(a, 0) or is_const(b, 0):
        return const(0)
    if is_const(a, 1):
        return b
    if is_const(b, 1):
        return a
    return Expr(Op.MUL, INDEX, (a, b))


def idiv(a: Expr, divisor: int) -> Expr:
    divisor = _sympy_of(divisor)
    if divisor == 1:
        return a
    if is_const(a):
        return const(a.arg // divisor)
    return Expr(Op.IDIV, INDEX, (a, const(divisor)))


def imod(a: Expr, divisor: int) -> Expr:
    divisor = _sympy_of(divisor)
    if divisor == 1:
        return const(0)
    if is_const(a):
        return const(a.arg % divisor)
    return Expr(Op.IMOD, INDEX, (a, const(divisor)))


def _sympy_of(n: object) -> object:
    """A symbolic size as its sympy expression (hashable, as Expr args must be); else `n`."""
    return n.node.expr if isinstance(n, torch.SymInt) else n


def is_symbolic_const(e: Expr) -> bool:
    """A constant whose value is a symbolic size's expression."""
    return e.op is Op.CONST and isinstance(e.arg, sympy.Expr)


def flat_index(index: list[Expr], strides: Iterable[int], offset: int = 0) -> Expr:
    out = const(offset)
    for i, s in zip(index, strides):
        out = iadd(out, imul(i, const(s)))
    return fold_unravelled(out)


def _scaled_terms(e: Expr) -> list[tuple[Expr, int]]:
    """`e`, a sum, as (term, constant factor) pairs; a sum times a constant is distributed."""
    out, stack = [], [(e, 1)]
    while stack:
        t, factor = stack.pop()
        if t.op is Op.ADD and t.dtype is INDEX:
            stack.extend((a, factor) for a in reversed(t.args))
        elif t.op is Op.MUL and t.dtype is INDEX and is_const(t.args[1]):
            stack.append((t.args[0], factor * t.args[1].arg))
        elif t.op is Op.MUL and t.dtype is INDEX and is_const(t.args[0]):
            stack.append((t.args[1], factor * t.args[0].arg))
        else:
            out.append((t, factor))
    return out


def _merge_pair(a: tuple[Expr, int], b: tuple[Expr, int]) -> tuple[Expr, int] | None:
    """(y // (p*q)) * (q*c) + ((y // p) % q) * c as (y // p) * c; p may be 1 (y % q)."""
    (div, c1), (mod, c2) = a, b
    if div.op is not Op.IDIV or mod.op is not Op.IMOD or not is_const(div.args[1]) or not is_const(mod.args[1]):
        return None
    y, whole, inner, q = div.args[0], div.args[1].arg, mod.args[0], mod.args[1].arg
    if inner.key() == y.key():
        p = 1
    elif inner.op is Op.IDIV and is_const(inner.args[1]) and inner.args[0].key() == y.key():
        p = inner.args[1].arg
    else:
        return None
    if p * q != whole or c1 != q * c2:
        return None
    return idiv(y, p), c2


def fold_unravelled(e: Expr) -> Expr:
    """`e` with the div/mod terms of an index unravelled over several dims and raveled again
    with matching strides folded back (a reshape of a contiguous tensor read through its
    view): ((y // 256) * 196608 + (y % 256) * 768) + x is y * 768 + x."""
    if e.op is not Op.ADD:
        return e
    terms = _scaled_terms(e)
    if not any(t.op is Op.IMOD for t, _ in terms):  # only a sum's own % terms merge (_merge_pair)
        return e
    count = len(terms)
    merged = True
    while merged:
        merged = False
        for i in range(len(terms)):
            for j in range(len(terms)):
                pair = _merge_pair(terms[i], terms[j]) if i != j else None
                if pair is not None:
                    terms[i] = pair
                    del terms[j]
                    merged = True
                    break
            if merged:
                break
    if len(terms) == count:
        return e
    out = const(0)
    for t, c in terms:
        out = iadd(out, imul(t, const(c)))
    return fold_unravelled(out)  # a merged term may be a sum that folds further (views of views)


def affine_terms(e: Expr) -> tuple[dict[str, int], int] | None:
    """`e` as (coefficient of each index variable, constant), or None if it is not affine."""
    if e.op is Op.CONST and e.dtype is INDEX:
        return {}, e.arg
    if e.op is Op.VAR:
        return {e.arg: 1}, 0
    if e.op is Op.ADD and e.dtype is INDEX:
        a, b = affine_terms(e.args[0]), affine_terms(e.args[1])
        if a is None or b is None:
            return None
        coefs = dict(a[0])
        for name, c in b[0].items():
            coefs[name] = coefs.get(name, 0) + c
        return coefs, a[1] + b[1]
    if e.op is Op.MUL and e.dtype is INDEX:
        for x, k in (e.args, e.args[::-1]):
            if is_const(k):
                inner = affine_terms(x)
                if inner is None:
                    return None
                return {name: c * k.arg for name, c in inner[0].items()}, inner[1] * k.arg
    return None


def linear_coefficient(e: Expr, name: str) -> int | None:
    """The coefficient of index variable `name` in `e`, a sum whose terms are affine in
    `name` or do not contain it (others may hold div/mod); None where `name` sits under a
    div, a mod or a product with another variable."""
    total = 0
    for t, c in _scaled_terms(e):
        if t.op is Op.VAR and t.arg == name:
            total += c
        elif t.op is Op.MUL and t.dtype is INDEX and any(is_const(k) for k in t.args):  # (x * 2) * 3
            inner = linear_coefficient(t, name)
            if inner is None:
                return None
            total += inner * c
        elif name in variables(t):
            return None
    return total


def contiguous_across(indexes: Iterable[Expr], row_vars: list[str], output_vars: list[str]) -> bool:
    """Whether most of a reduction's `indexes` that vary along its rows step by 1 along an
    output variable rather than along a row variable: the rows are read across, contiguous
    along the outputs (per-channel sums of channels-last activations, a layer norm's weight
    gradient). An index that does not vary along the rows (a mean, a weight) has no say."""
    votes = 0
    for index in indexes:
        if all(linear_coefficient(index, v) == 0 for v in row_vars):
            continue
        if any(linear_coefficient(index, v) == 1 for v in row_vars):
            votes -= 1
        elif any(linear_coefficient(index, v) == 1 for v in output_vars):
            votes += 1
    return votes > 0


def unravel(flat: Expr, shape: Iterable[int]) -> list[Expr]:
    """The n-d index of a row-major position `flat` in `shape`."""
    shape = list(shape)
    if 0 in shape:
        return [const(0) for _ in shape]
    out, outermost = [], True
    for size, inner in zip(shape, inner_sizes(shape)):
        if size == 1:
            out.append(const(0))
        else:
            q = idiv(flat, inner)
            out.append(q if outermost else imod(q, size))
            outermost = False
    return out


def inner_sizes(shape: Iterable[int]) -> list[int]:
    """For each dim of a row-major `shape`, the number of elements one step along it spans: the
    product of the sizes after it (0 throughout where a size is 0). Multiplied, never divided:
    symbolic sizes divided are sympy FloorDivs, slow to simplify."""
    shape = list(shape)
    if 0 in shape:
        return [0] * len(shape)
    inner, out = 1, []
    for size in reversed(shape):
        out.append(inner)
        inner = inner * size
    return out[::-1]


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(list(shape)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


# -- rewriting ------------------------------------------------------------------


def rewrite(e: Expr, leaf_fn: Callable[[Expr], Expr | None], memo: dict | None = None) -> Expr:
    """Rebuild `e` bottom-up; `leaf_fn(node)` may replace any node (given rewritten args), once:
    a node that simplifies to one of its rewritten parts is not passed to it again."""
    memo = {} if memo is None else memo
    got = memo.get(id(e))
    if got is not None:
        return got[1]
    node = e
    if e.args:  # (leaves, most nodes, skip the tuple and the comparison)
        args = tuple([rewrite(a, leaf_fn, memo) for a in e.args])
        if any(x is not y for x, y in zip(args, e.args)):
            node = _rebuild(e, args)
            if not node.args or any(node is a for a in args):
                # simplified to one of its rewritten args (`0 + d1` -> d1), or to a leaf of them
                # (`(d1 * 4) // 4` -> d1): that has been through leaf_fn already, and a second
                # pass would substitute d1 again (a view's index lost a dim that way)
                memo[id(e)] = (e, node)
                return node
    out = leaf_fn(node)
    out = node if out is None else out
    memo[id(e)] = (e, out)  # keep e alive so id() stays unique
    return out


def _rebuild(e: Expr, args: tuple[Expr, ...]) -> Expr:
    if e.dtype is INDEX and e.op in (Op.ADD, Op.MUL, Op.IDIV, Op.IMOD) and all(a.dtype is INDEX for a in args):
        if e.op is Op.ADD:
            return iadd(*args)
        if e.op is Op.MUL:
            return imul(*args)
        if is_const(args[1]):
            return (idiv if e.op is Op.IDIV else imod)(args[0], args[1].arg)
    if e.op is Op.CAST and args[0].op is Op.CONST and not is_symbolic_const(args[0]):  # (a substitution's)
        return cast_const(args[0], e.dtype)
    return Expr(e.op, e.dtype, args, e.arg)


def cast_const(c: Expr, dtype: torch.dtype) -> Expr:
    """The constant `c` converted to `dtype` as torch converts it (rounded to a half type's
    precision, truncated to an integer): renderers need not cast literals."""
    return const(torch.tensor(c.arg, dtype=c.dtype).to(dtype).item(), dtype)


def substitute(e: Expr, index: list[Expr]) -> Expr:
    """`e` (written over d0..dN-1) evaluated at `index`."""
    if e.op is Op.CONST:
        return e
    if e.op is Op.VAR:  # most calls: one dim of a buffer's own index, read at a reader's
        name = e.arg
        position = int(name[1:]) if name[:1] == "d" and name[1:].isdigit() else len(index)
        return index[position] if position < len(index) else e
    mapping = {f"d{i}": x for i, x in enumerate(index)}
    return rewrite(e, lambda n: mapping.get(n.arg) if n.op is Op.VAR else None)


def walk(e: Expr) -> Iterable[Expr]:
    """Every distinct node of `e`, children before parents."""
    seen: set[int] = set()
    stack = [(e, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in seen:
            continue
        if done:
            seen.add(id(node))
            yield node
        else:
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if id(a) not in seen)


def loads(e: Expr) -> list[Expr]:
    """The LOAD nodes of `e`, each once, in walk's order; kept on each node (expressions are
    immutable and share subtrees, and the scheduler and the renderers ask again and again:
    resnet50's training graphs asked 9,500 times, each a walk of the whole tree)."""
    found = e._loads
    if found is None:
        seen: set[int] = set()
        collected = []
        for a in reversed(e.args):  # walk visits the last argument's subtree first
            for n in loads(a):
                if id(n) not in seen:
                    seen.add(id(n))
                    collected.append(n)
        if e.op is Op.LOAD:
            collected.append(e)
        found = tuple(collected)
        object.__setattr__(e, "_loads", found)
    return list(found)


def variables(e: Expr) -> frozenset:
    """The names of the index variables (VAR nodes) in `e`, kept on each node as loads() is."""
    found = e._variables
    if found is None:
        if e.op is Op.VAR:
            found = frozenset((e.arg,))
        else:
            found = frozenset().union(*map(variables, e.args)) if e.args else frozenset()
        object.__setattr__(e, "_variables", found)
    return found


# =============================================================================
# Buffers: the nodes a lowered graph is made of
# =============================================================================


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Where a stored tensor's elements are: shape, strides and storage offset. Two layouts are
    equal where their sizes are the same expressions (symbols.size_key): symbolic sizes are
    compared without a guard, so that layouts equal at one call's sizes only count as different."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0

    def key(self) -> tuple:
        return tuple(map(size_key, self.shape)), tuple(map(size_key, self.stride)), size_key(self.offset)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    @staticmethod
    def contiguous(shape: Iterable[int]) -> "Layout":
        shape = tuple(shape)
        return Layout(shape, contiguous_strides(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(eq=False)
class InputBuffer:
    """A graph input or a constant the graph holds (a parameter)."""

    name: str
    dtype: torch.dtype
    layout: Layout
    device: torch.device


@dataclasses.dataclass(eq=False)
class Pointwise:
    """`body` (over d0..dN-1) at every index of `shape`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    body: Expr
    device: torch.device
    layout: Layout | None = None  # where it is stored, if the schedule stores it
    _reads: tuple | None = dataclasses.field(default=None, init=False, repr=False)

    def reads(self) -> frozenset[str]:
        return _body_reads(self)


@dataclasses.dataclass(eq=False)
class Reduction:
    """`reduce_op` of `body` (over the full shape's d0..dN-1) along `reduced` dims.

    The result's shape is the full shape without the reduced dims."""

    name: str
    dtype: torch.dtype
    full_shape: tuple[int, ...]
    reduced: tuple[int, ...]
    reduce_op: Op
    body: Expr
    device: torch.device
    layout: Layout | None = None
    _reads: tuple | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.full_shape) if i not in self.reduced)

    def reads(self) -> frozenset[str]:
        return _body_reads(self)


def _body_reads(buf: "Pointwise | Reduction") -> frozenset[str]:
    """The buffers `buf.body` loads, kept beside the body they came from: lowering and
    scheduling ask a buffer for them again and again (GPT-2's backward: thousands of times),
    and a rule or pass may replace the body."""
    cached = buf._reads
    if cached is None or cached[0] is not buf.body:
        cached = buf._reads = (buf.body, frozenset(n.arg for n in loads(buf.body)))
    return cached[1]


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A tensor argument of an extern call: a stored buffer seen through a strided layout."""

    buffer: str
    layout: Layout


@dataclasses.dataclass(eq=False)
class Extern:
    """A call to an aten kernel; `args`/`kwargs` hold `TensorArg`s where tensors go.

    `outputs` are the layouts of the tensor results (one per result; `multi`
    says the op returns a tuple)."""

    name: str
    target: object  # an OpOverload
    args: tuple
    kwargs: dict
    outputs: tuple[tuple[torch.dtype, Layout], ...]
    multi: bool
    device: torch.device
    reason: str = ""

    def reads(self) -> set[str]:
        import torch.utils._pytree as pytree

        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return {a.buffer for a in leaves if isinstance(a, TensorArg)}

    def output_name(self, i: int) -> str:
        return f"{self.name}_{i}" if self.multi else self.name

    def viewed(self) -> set[str]:
        """The buffers whose memory the results may be views of: the arguments that the
        schema marks as aliased when it marks a result so (`as_strided(Tensor(a) self)
        -> Tensor(a)`). Such a buffer lives as long as the results do."""
        if not returns_alias(self.target):
            return set()
        schema = self.target._schema
        aliased = {a.name for a in schema.arguments if a.alias_info is not None}
        named = dict(zip([a.name for a in schema.arguments], self.args)) | self.kwargs
        return {v.buffer for k, v in named.items() if k in aliased and isinstance(v, TensorArg)}


def returns_alias(target) -> bool:
    """Whether the op `target` may return a view of an argument (its schema says so)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


Buffer = InputBuffer | Pointwise | Reduction | Extern


def producer_of(name: str, buffers: dict) -> tuple[Buffer | None, int]:
    """The buffer that computes `name`, and which of its results `name` is: one result
    of a multi-result extern is named `<extern>_<i>` (Extern.output_name)."""
    buf = buffers.get(name)
    if buf is not None:
        return buf, 0
    base, _, index = name.rpartition("_")
    return buffers.get(base), int(index) if index.isdigit() else 0


def cheap_to_recompute(buf: Pointwise, buffers: dict) -> bool:
    """Whether every reader of `buf` may recompute it instead of loading it: a small
    body that loads at most one buffer of comparable size (a bias add, a cast, an
    activation). Each reader then loads that one buffer where it would have loaded
    `buf`, so memory traffic never grows, and `buf` itself is never written."""
    nodes = list(walk(buf.body))
    if len(nodes) > tuning.inline_max_nodes:
        return False
    size = hint(math.prod(buf.shape))  # (over symbols, at the call compiled: either answer computes the same)
    fraction = tuning.small_read_fraction
    large = {n.arg for n in nodes if n.op is Op.LOAD and hint(stored_numel(n.arg, buffers)) * fraction > size}
    return len(large) <= 1


def broadcasts_costly_math(buf: Pointwise, readers: list) -> bool:
    """Whether a reader recomputing `buf` would evaluate its costly functions (OpSet.Costly)
    many times for each of its elements: a reader iterating over tuning.costly_broadcast_ratio
    times more elements than `buf` has broadcasts it, and one over tuning.costly_broadcast_min
    elements recomputes enough to pay for a kernel of its own. Llama's rotary embedding took the
    cosine and sine of its (length, head dim) table once per batch row and head in each kernel
    that rotated queries or keys: 3 libdevice calls an element made those kernels compute-bound
    (48 us against 12 at the H200's bandwidth). Stored, the table is computed once and loaded
    from cache. (A decoding step's table of one position is recomputed: a launch costs more.)"""
    if not any(n.op in OpSet.Costly for n in walk(buf.body)):
        return False
    size = hint(math.prod(buf.shape))
    iterations = [hint(math.prod(r.full_shape if isinstance(r, Reduction) else r.shape)) for r in readers]
    return any(n >= tuning.costly_broadcast_ratio * size and n >= tuning.costly_broadcast_min for n in iterations)


def stored_numel(name: str, buffers: dict) -> int:
    """The number of elements of buffer `name`."""
    buf, index = producer_of(name, buffers)
    if isinstance(buf, InputBuffer):
        return buf.layout.numel
    if isinstance(buf, Extern):
        return buf.outputs[index][1].numel
    return math.prod(buf.shape)
