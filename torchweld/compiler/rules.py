"""One lowering rule per aten op: how it becomes a Pointwise, a Reduction or a View.

A rule takes the `GraphLowering`, the fx node, and the node's arguments (tensors
as `BufferView`s) and returns the node's value. It raises NotImplementedError
for a case it does not cover; the node then becomes an extern call.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch.utils._sympy.functions import ToFloat

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Layout, Op
from torchweld.compiler.lowering import GraphLowering, RuleNode, BufferView, draws_a_seed, meta_layout
from torchweld.compiler.symbols import compile_kept, fake_mode, is_symbol_size
from torchweld.runtime import pool_offsets, seeded_rand
from torchweld.tuning import tuning

aten = torch.ops.aten
prims = torch.ops.prims

LOWERINGS: dict[object, Callable] = {}


def lowers(*targets):
    def register(fn):
        for t in targets:
            if t in LOWERINGS:
                raise ValueError(f"two lowerings for {t}")
            LOWERINGS[t] = fn
        return fn

    return register


# =============================================================================
# Helpers
# =============================================================================


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype we compute in: half types in float32, like eager's CPU kernels."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def cast(e: Expr, dtype: torch.dtype) -> Expr:
    if e.dtype == dtype:
        return e
    if e.op is Op.CONST:
        return ir.const(e.arg, dtype)
    return Expr(Op.CAST, dtype, (e,))


def broadcast_read(x: BufferView, shape, index: list[Expr]) -> Expr:
    """Read `x` at `index` of the broadcast `shape` (numpy rules, right-aligned)."""
    lead = len(shape) - len(x.shape)
    idx = [ir.const(0) if size == 1 else index[lead + i] for i, size in enumerate(x.shape)]
    return x.read(idx)


def operand(a, shape, index, dtype: torch.dtype) -> Expr:
    if isinstance(a, BufferView):
        return cast(broadcast_read(a, shape, index), dtype)
    return ir.const(a, dtype)


def out_val(node: torch.fx.Node) -> torch.Tensor:
    return node.meta["val"]


# where a float computed from symbolic sizes (`x * n ** 0.5`) may be an operand: as a 0-d tensor
# of the compute dtype, eager's result (a Python float is rounded to it alike); not a division
# (eager's CUDA kernel multiplies by the reciprocal) nor anything else yet
SCALAR_OPERAND_OPS = frozenset({aten.mul, aten.add, aten.sub, prims.mul, prims.add, prims.sub})


def make_pointwise(L: GraphLowering, node, fn, args, compute: torch.dtype) -> BufferView:
    val = out_val(node)
    if any(isinstance(a, torch.SymFloat) and a.node.expr.func is not ToFloat for a in args):
        if getattr(node.target, "overloadpacket", None) not in SCALAR_OPERAND_OPS or not compute.is_floating_point:
            raise NotImplementedError(f"a float of symbolic sizes as an operand of {node.target}")
        args = [L.number_tensor(a, compute, val.device) if isinstance(a, torch.SymFloat) else a for a in args]
    shape = tuple(val.shape)
    index = ir.dim_vars(len(shape))
    body = fn(*(operand(a, shape, index, compute) for a in args))
    body = cast(body, upcast(val.dtype))
    return L.add_pointwise(body, val.dtype, shape, val.device, meta_layout(val))


def meta_of(a):
    return a if not isinstance(a, torch.fx.Node) else a.meta["val"]


def promoted(node: torch.fx.Node, *arg_positions: int) -> torch.dtype:
    """The common dtype of some of the node's arguments (for comparisons)."""
    vals = [meta_of(node.args[i]) for i in arg_positions if i < len(node.args)]
    dtype = vals[0].dtype if isinstance(vals[0], torch.Tensor) else None
    if len(vals) == 2:
        dtype = torch.result_type(vals[0], vals[1])
    return upcast(dtype)


def unop(op: Op) -> Callable[[Expr], Expr]:
    return lambda x: Expr(op, x.dtype, (x,))


def binop(op: Op) -> Callable[[Expr, Expr], Expr]:
    if op in ir.OpSet.Comparison:
        return lambda a, b: Expr(op, torch.bool, (a, b))
    return lambda a, b: Expr(op, a.dtype, (a, b))


def fused_multiply_add(a: Expr, b: Expr, c: Expr) -> Expr:
    """a * b + c rounded once, where aten's kernel for one op computes it so (add's alpha, lerp,
    addcmul: Vectorized fmadd, or g++ contracting its scalar loop); integers as two ops."""
    if a.dtype.is_floating_point:
        return Expr(Op.FMA, a.dtype, (a, b, c))
    return binop(Op.ADD)(binop(Op.MUL)(a, b), c)


# =============================================================================
# Pointwise
# =============================================================================

UNARY = {
    aten.abs: Op.ABS, aten.neg: Op.NEG, aten.exp: Op.EXP, aten.expm1: Op.EXPM1, aten.log: Op.LOG,
    aten.log1p: Op.LOG1P, aten.log2: Op.LOG2, aten.sin: Op.SIN, aten.cos: Op.COS, aten.tan: Op.TAN,
    aten.tanh: Op.TANH, aten.atan: Op.ATAN, aten.sqrt: Op.SQRT, aten.rsqrt: Op.RSQRT,
    aten.reciprocal: Op.RECIPROCAL, aten.sigmoid: Op.SIGMOID, aten.erf: Op.ERF, aten.floor: Op.FLOOR,
    aten.ceil: Op.CEIL, aten.trunc: Op.TRUNC, aten.round: Op.ROUND, aten.sign: Op.SIGN,
    aten.bitwise_not: Op.BITWISE_NOT,
}
BINARY = {
    aten.mul: Op.MUL, aten.maximum: Op.MAXIMUM, aten.minimum: Op.MINIMUM, aten.atan2: Op.ATAN2,
    aten.floor_divide: Op.FLOORDIV, aten.remainder: Op.REMAINDER,
    aten.bitwise_and: Op.BITWISE_AND, aten.bitwise_or: Op.BITWISE_OR, aten.bitwise_xor: Op.BITWISE_XOR,
}
COMPARE = {aten.lt: Op.LT, aten.le: Op.LE, aten.gt: Op.GT, aten.ge: Op.GE, aten.eq: Op.EQ, aten.ne: Op.NE}
LOGICAL = {aten.logical_and: Op.LOGICAL_AND, aten.logical_or: Op.LOGICAL_OR, aten.logical_xor: Op.LOGICAL_XOR}


def _register_tables() -> None:
    for target, op in UNARY.items():
        def unary_rule(L, node, x, *_, op=op):
            if op is Op.BITWISE_NOT and x.dtype is torch.bool:
                op = Op.LOGICAL_NOT
            if op is Op.ROUND and len(node.args) > 1:
                raise NotImplementedError("round(decimals=)")
            if op in ir.OpSet.Transcendental and not out_val(node).dtype.is_floating_point:
                raise NotImplementedError(f"{op.name} of {x.dtype}")
            compute = upcast(out_val(node).dtype)
            if op is Op.SIGN and x.dtype is torch.bool:
                return make_pointwise(L, node, lambda a: a, [x], torch.bool)
            return make_pointwise(L, node, unop(op), [x], compute)

        lowers(target)(unary_rule)
    for target, op in BINARY.items():
        def binary_rule(L, node, a, b, op=op):
            if op in (Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR) and out_val(node).dtype is torch.bool:
                op = {Op.BITWISE_AND: Op.LOGICAL_AND, Op.BITWISE_OR: Op.LOGICAL_OR}.get(op, Op.LOGICAL_XOR)
                return make_pointwise(L, node, binop(op), [a, b], torch.bool)
            return make_pointwise(L, node, binop(op), [a, b], upcast(out_val(node).dtype))

        lowers(target)(binary_rule)
    for target, op in COMPARE.items():
        lowers(target)(lambda L, node, a, b, op=op: make_pointwise(L, node, binop(op), [a, b], promoted(node, 0, 1)))
    for target, op in LOGICAL.items():
        lowers(target)(lambda L, node, a, b, op=op: make_pointwise(L, node, binop(op), [a, b], torch.bool))


_register_tables()


@lowers(aten.logical_not)
def logical_not(L, node, x):
    return make_pointwise(L, node, unop(Op.LOGICAL_NOT), [x], torch.bool)


@lowers(aten.isnan)
def isnan(L, node, x):
    if not x.dtype.is_floating_point:
        return make_pointwise(L, node, lambda a: ir.const(False), [x], torch.bool)
    return make_pointwise(L, node, lambda a: Expr(Op.ISNAN, torch.bool, (a,)), [x], upcast(x.dtype))


@lowers(aten.add, aten.sub)
def add_sub(L, node, a, b, alpha=1):
    op = Op.ADD if node.target.overloadpacket is aten.add else Op.SUB
    dtype = out_val(node).dtype
    if dtype is torch.bool:
        if op is Op.SUB:
            raise NotImplementedError("bool subtraction")
        return make_pointwise(L, node, binop(Op.LOGICAL_OR), [a, b], torch.bool)

    if alpha != 1 and dtype.is_floating_point:  # aten takes alpha in the tensors' dtype (a half's 0.3 is 0.2998)
        alpha = torch.tensor(alpha, dtype=dtype).item()

    def fn(x, y):
        if alpha != 1:  # aten: fmadd(y, alpha, x), and x - alpha * y as x + (-alpha) * y
            return fused_multiply_add(y, ir.const(alpha if op is Op.ADD else -alpha, y.dtype), x)
        return Expr(op, x.dtype, (x, y))

    return make_pointwise(L, node, fn, [a, b], upcast(dtype))


@lowers(prims.add, prims.sub, prims.mul, prims.div)
def prims_binary(L, node, a, b):
    dtype = out_val(node).dtype
    op = {prims.add: Op.ADD, prims.sub: Op.SUB, prims.mul: Op.MUL}.get(node.target.overloadpacket)
    if op is None:  # prims.div: true division for floats, truncation for ints
        if not dtype.is_floating_point:
            raise NotImplementedError("prims.div of integers")
        op = Op.TRUEDIV
    return make_pointwise(L, node, binop(op), [a, b], upcast(dtype))


@lowers(aten.div)
def div(L, node, a, b, rounding_mode=None):
    dtype = out_val(node).dtype
    compute = upcast(dtype)
    if rounding_mode is None:
        return make_pointwise(L, node, binop(Op.TRUEDIV), [a, b], compute)
    if rounding_mode == "floor":
        return make_pointwise(L, node, binop(Op.FLOORDIV), [a, b], compute)
    if dtype.is_floating_point:  # trunc
        return make_pointwise(L, node, lambda x, y: unop(Op.TRUNC)(binop(Op.TRUEDIV)(x, y)), [a, b], compute)
    raise NotImplementedError("integer division with rounding_mode='trunc'")


@lowers(aten.pow)
def pow_(L, node, a, b):
    dtype = out_val(node).dtype
    if not dtype.is_floating_point:
        raise NotImplementedError("integer pow")
    if not isinstance(b, BufferView) and b in (1, 2, 3, 0.5, -1):
        fn = {
            1: lambda x, y: x,
            2: lambda x, y: binop(Op.MUL)(x, x),
            3: lambda x, y: binop(Op.MUL)(binop(Op.MUL)(x, x), x),
            0.5: lambda x, y: unop(Op.SQRT)(x),
            -1: lambda x, y: unop(Op.RECIPROCAL)(x),
        }[b]
        return make_pointwise(L, node, fn, [a, b], upcast(dtype))
    return make_pointwise(L, node, binop(Op.POW), [a, b], upcast(dtype))


@lowers(aten.relu)
def relu(L, node, x):
    if x.dtype is torch.bool:
        raise NotImplementedError("relu of bool")
    return make_pointwise(L, node, lambda a: clamped(a, 0, None), [x], upcast(x.dtype))


def clamped(a: Expr, lo, hi) -> Expr:
    """`a` clamped as eager clamps: a bound replaces `a` only where `a` is past it, so NaN
    stays NaN and relu(-0.0) stays -0.0 (a maximum with 0 made it +0.0); lo first, then hi."""
    if lo is not None:
        bound = ir.const(lo, a.dtype)
        a = Expr(Op.WHERE, a.dtype, (Expr(Op.LT, torch.bool, (a, bound)), bound, a))
    if hi is not None:
        bound = ir.const(hi, a.dtype)
        a = Expr(Op.WHERE, a.dtype, (Expr(Op.GT, torch.bool, (a, bound)), bound, a))
    return a


@lowers(aten.clamp)
def clamp(L, node, x, min=None, max=None):
    if isinstance(min, BufferView) or isinstance(max, BufferView):
        raise NotImplementedError("clamp with tensor bounds")
    return make_pointwise(L, node, lambda a: clamped(a, min, max), [x], upcast(out_val(node).dtype))


@lowers(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, prims.where)
def where(L, node, cond, a, b):
    val = out_val(node)
    shape = tuple(val.shape)
    index = ir.dim_vars(len(shape))
    compute = upcast(val.dtype)
    c = operand(cond, shape, index, torch.bool)
    body = Expr(Op.WHERE, compute, (c, operand(a, shape, index, compute), operand(b, shape, index, compute)))
    return L.add_pointwise(body, val.dtype, shape, val.device, meta_layout(val))


# -- copies and casts --------------------------------------------------------------


@lowers(prims.convert_element_type, aten._to_copy, aten.clone, aten.lift_fresh_copy, aten._to_dense)
def to_copy(L, node, x, *args, **kwargs):
    val = out_val(node)
    if val.device != x.device:
        raise NotImplementedError("a copy to another device")
    return make_pointwise(L, node, lambda a: a, [x], val.dtype)


@lowers(aten.copy)
def copy(L, node, dst, src, non_blocking=False):
    val = out_val(node)
    if isinstance(src, BufferView) and src.device != val.device:
        raise NotImplementedError("a copy from another device")
    return make_pointwise(L, node, lambda a: a, [src], val.dtype)


@lowers(aten.alias, aten.detach, aten.lift_fresh)
def alias(L, node, x, *args):
    return x


# -- tensors made from nothing ------------------------------------------------------


def filled(L, node, value) -> BufferView:
    val = out_val(node)
    body = ir.const(value, upcast(val.dtype))
    return L.add_pointwise(body, val.dtype, tuple(val.shape), val.device, meta_layout(val))


@lowers(aten.full, aten.scalar_tensor, aten.zeros, aten.ones, aten.empty.memory_format, aten.empty_strided,
        aten.fill.Scalar, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
def full(L, node, *args, **kwargs):
    t = node.target.overloadpacket
    if t in (aten.zeros, aten.zeros_like, aten.empty, aten.empty_strided, aten.empty_like):
        value = 0
    elif t in (aten.ones, aten.ones_like):
        value = 1
    elif t is aten.scalar_tensor:
        value = args[0]
    else:  # full(size, value), fill(self, value), full_like(self, value)
        value = args[1]
    if isinstance(value, BufferView):
        raise NotImplementedError("fill with a tensor value")
    return filled(L, node, value)


@lowers(aten.rand_like.default, aten.rand.default, aten.bernoulli.p)
def rand(L, node, *args, **kwargs):
    """Random numbers drawn inside the kernels that read them (dropout's mask), from a seed
    of this graph run. rand and rand_like are uniform in [0, 1); bernoulli(x, p) is 1 with
    probability p, else 0."""
    if kwargs.get("generator") is not None:
        raise NotImplementedError("random numbers from a generator of the program's own")
    val = drawn_value(out_val(node))
    body = uniform(val, L.next_seed(val.device))
    if node.target is aten.bernoulli.p:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        body = Expr(Op.LT, torch.bool, (body, ir.const(p, torch.float32)))
    else:
        body = below_one(body, val.dtype)
    return drawn(L, val, body)


@lowers(seeded_rand.seeded_rand)
def rand_from_seed(L, node, seed, size, dtype):
    """rand(size) from a seed tensor (runtime/seeded_rand.py): the forward, and the backward
    that draws dropout's mask again, read the same seed and draw the same numbers."""
    if not isinstance(seed, BufferView):
        raise NotImplementedError("a seed that is not a tensor")
    val = drawn_value(out_val(node))
    return drawn(L, val, below_one(uniform(val, operand(seed, (), (), torch.int64)), val.dtype))


@lowers(aten.randint.low)
def seed(L, node, *args, **kwargs):
    """A seed for seeded_rand (lowering.draws_a_seed): one of the seeds drawn at the graph's start."""
    if not draws_a_seed(node):
        raise NotImplementedError("random integers other than a seed")
    return L.next_seed_value(out_val(node).device)


def drawn_value(val: torch.Tensor) -> torch.Tensor:
    """`val`, where the kernels draw its numbers (seeded_rand.drawable); checked before a seed is taken."""
    if not seeded_rand.drawable(val):
        raise NotImplementedError(f"random {val.dtype} of {val.numel()} elements (32-bit draws)")
    return val


def drawn(L, val: torch.Tensor, body: Expr) -> BufferView:
    """The buffer of random numbers (or a mask of them) `body` computes, in `val`'s dtype and layout."""
    return L.add_pointwise(cast(body, upcast(val.dtype)), val.dtype, tuple(val.shape), val.device, meta_layout(val))


def uniform(val: torch.Tensor, seed: Expr) -> Expr:
    """float32 numbers uniform in [0, 1) for `val`'s elements, from `seed`: a Philox counter
    at each element's row-major position."""
    offset = ir.flat_index(ir.dim_vars(val.dim()), ir.contiguous_strides(val.shape))
    return Expr(Op.RAND, torch.float32, (seed, offset))


def below_one(body: Expr, dtype: torch.dtype) -> Expr:
    """Uniform numbers that stay below 1 once rounded to `dtype` (a half type)."""
    if dtype not in seeded_rand.BELOW_ONE:
        return body
    return Expr(Op.MINIMUM, torch.float32, (body, ir.const(seeded_rand.BELOW_ONE[dtype], torch.float32)))


@lowers(aten.arange.start_step, aten.arange.start, aten.arange.default, prims.iota)
def arange(L, node, *args, **kwargs):
    val = out_val(node)
    if node.target is prims.iota.default:
        start, step = kwargs["start"], kwargs["step"]
    else:
        start, step = (0, 1) if node.target is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
    compute = upcast(val.dtype)
    d0 = cast(ir.var("d0"), compute)
    body = Expr(Op.ADD, compute, (ir.const(start, compute), Expr(Op.MUL, compute, (d0, ir.const(step, compute)))))
    return L.add_pointwise(body, val.dtype, tuple(val.shape), val.device, meta_layout(val))


@lowers(aten.addcmul, aten.addcdiv)
def addcmul_addcdiv(L, node, x, a, b, value=1):
    """x + value * a * b, x + value * (a / b), in the order aten's kernels compute them."""
    divide = node.target.overloadpacket is aten.addcdiv

    def fn(s, t1, t2):
        if divide:
            term = binop(Op.TRUEDIV)(t1, t2)
            term = term if value == 1 else binop(Op.MUL)(ir.const(value, term.dtype), term)
        else:  # aten: x + value * a * b, its last product and the sum contracted into one fma
            scaled = binop(Op.MUL)(ir.const(value, t1.dtype), t1) if value != 1 else t1
            return fused_multiply_add(scaled, t2, s)
        return binop(Op.ADD)(s, term)

    return make_pointwise(L, node, fn, [x, a, b], upcast(out_val(node).dtype))


@lowers(aten.lerp)
def lerp(L, node, start, end, weight):
    """aten's formula, exact at both ends: start + w * (end - start) where |w| < 0.5, else
    end - (end - start) * (1 - w), each one fma as aten's kernel computes it
    (fmadd(w, diff, start), fmadd(w - 1, diff, end)); for a tensor weight (Adam's live betas)
    a select per element between the two."""
    def near_start(s, diff, w):
        return fused_multiply_add(w, diff, s)

    def near_end(e, diff, w):
        return fused_multiply_add(binop(Op.SUB)(w, ir.const(1, w.dtype)), diff, e)

    if isinstance(weight, BufferView):
        def fn(s, e, w):
            diff = binop(Op.SUB)(e, s)
            small = binop(Op.LT)(unop(Op.ABS)(w), ir.const(0.5, w.dtype))
            return Expr(Op.WHERE, s.dtype, (small, near_start(s, diff, w), near_end(e, diff, w)))

        return make_pointwise(L, node, fn, [start, end, weight], upcast(out_val(node).dtype))

    def fn(s, e):  # the formula chosen once; w - 1 in the compute dtype, as aten's kernel computes it
        diff, w = binop(Op.SUB)(e, s), ir.const(weight, s.dtype)
        if abs(weight) < 0.5:
            return near_start(s, diff, w)
        below = (torch.tensor(weight, dtype=s.dtype) - 1).item()  # computed here: a renderer may fold it in double
        return fused_multiply_add(ir.const(below, s.dtype), diff, e)

    return make_pointwise(L, node, fn, [start, end], upcast(out_val(node).dtype))


# =============================================================================
# Multi-tensor (foreach) ops: an optimizer step
# =============================================================================

# `aten._foreach_<name>` lowers as `aten.<name>` on each element. Every element's result
# is a buffer of its own, so one tensor's chain of updates (Adam's ~15 foreach ops on
# a parameter and its state) fuses into one kernel.
FOREACH_ELEMENT_OPS = ("add", "sub", "mul", "div", "neg", "sqrt", "reciprocal", "pow", "lerp", "addcmul",
                       "addcdiv", "maximum", "minimum", "abs", "exp", "sign")


def foreach(L, node, *args, **kwargs):
    packet = getattr(aten, node.target.overloadpacket.__name__.removeprefix("_foreach_"))
    if packet in (aten.maximum, aten.minimum) and node.target._overloadname != "List":
        raise NotImplementedError(f"{node.target}: aten.{packet.__name__} takes no scalar")
    single = getattr(packet, packet.overloads()[0])
    rule = LOWERINGS[packet]
    lists = [i for i, a in enumerate(node.args) if isinstance(a, (list, tuple))]
    vals = node.meta.get("val")
    results = []
    for i in range(len(node.args[lists[0]])):
        element_nodes = tuple(a[i] if j in lists else a for j, a in enumerate(node.args))
        element_args = [a[i] if j in lists else a for j, a in enumerate(args)]
        val = vals[i] if vals else meta_of(node.args[0][i])  # an in-place op's result is like `self`
        element = RuleNode(single, element_nodes, node.kwargs, {"val": val}, f"{node.name}_{i}")
        results.append(rule(L, element, *element_args, **kwargs))
    return results


lowers(*(getattr(aten, f"_foreach_{name}") for name in FOREACH_ELEMENT_OPS))(foreach)


# =============================================================================
# Reductions
# =============================================================================

REDUCE_INIT = {Op.SUM: 0, Op.PROD: 1}


def reduce(L, node, x: BufferView, dims, keepdim: bool, reduce_op: Op, acc_dtype=None) -> BufferView:
    val = out_val(node)
    ndim = len(x.shape)
    if dims is None or (not isinstance(dims, int) and len(dims) == 0 and node.target.overloadpacket is not prims.sum):
        dims = list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = sorted({d % ndim for d in dims}) if ndim else []
    acc = acc_dtype or upcast(val.dtype)
    if not dims:
        return make_pointwise(L, node, lambda a: a, [x], acc)
    body = cast(x.read(ir.dim_vars(ndim)), acc)
    red = L.add_reduction(x, dims, reduce_op, body, val.dtype)
    if keepdim:
        return keep_dims(red, x.shape, dims)
    return red


def keep_dims(red: BufferView, full_shape, dims) -> BufferView:
    """`red` with size-1 dims put back where `dims` were reduced (a view)."""
    shape = tuple(1 if i in dims else s for i, s in enumerate(full_shape))
    index = ir.dim_vars(len(shape))
    kept = [index[i] for i in range(len(shape)) if i not in dims]
    index_ = tuple(ir.substitute(e, kept) for e in red.index)
    layout = replay_layout(red.layout, lambda t: t.reshape(shape), any(map(is_symbol_size, shape)), ("reshape", shape))
    return BufferView(red.root, red.dtype, shape, red.device, index_, layout)


@lowers(aten.sum.dim_IntList, aten.sum.default, prims.sum)
def sum_(L, node, x, dims=None, keepdim=False, dtype=None, **kwargs):
    return reduce(L, node, x, dims, keepdim, Op.SUM)


@lowers(aten.prod.dim_int, aten.prod.default)
def prod(L, node, x, dim=None, keepdim=False, dtype=None):
    return reduce(L, node, x, dim, keepdim, Op.PROD)


@lowers(aten.amax, aten.amin, prims.amax, prims.amin)
def amax(L, node, x, dims=None, keepdim=False):
    op = Op.MAX if node.target.overloadpacket in (aten.amax, prims.amax) else Op.MIN
    return reduce(L, node, x, dims, keepdim, op)


@lowers(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default)
def any_all(L, node, x, dims=None, keepdim=False):
    op = Op.MAX if node.target.overloadpacket is aten.any else Op.MIN
    return reduce(L, node, x, dims, keepdim, op, acc_dtype=torch.bool)


@lowers(prims.var)
def var(L, node, x, dims, correction=1.0, *, output_dtype=None):
    """Two reductions in one kernel: the mean, then the squared deviations from it. The mean
    is summed as deviations from the row's first element (a shift): a row of large equal
    values (4 x 1e38) then sums to 0, not to inf, and rows far from 0 lose no digits to it."""
    val = out_val(node)
    ndim = len(x.shape)
    dims = sorted({d % ndim for d in dims})
    n = math.prod(x.shape[d] for d in dims)
    acc = upcast(x.dtype)
    index = ir.dim_vars(ndim)
    kept = [index[i] for i in range(ndim) if i not in dims]
    xs = cast(x.read(index), acc)
    first = [ir.const(0) if i in dims else index[i] for i in range(ndim)]
    shift = cast(x.read(first), acc) if n else ir.const(0, acc)
    total = L.add_reduction(x, dims, Op.SUM, Expr(Op.SUB, acc, (xs, shift)), acc)
    mean = Expr(Op.ADD, acc, (shift, Expr(Op.TRUEDIV, acc, (total.read(kept), ir.const(max(n, 1), acc)))))
    # var_mean's mean sums x again: it reads n * shift + total instead of a third sum
    out = ir.dim_vars(len(kept))
    plain = Expr(Op.ADD, acc, (Expr(Op.MUL, acc, (ir.substitute(shift, _spread(out, ndim, dims)), ir.const(n, acc))),
                               total.read(out)))
    L.known_reduction(x, dims, Op.SUM, xs, x.dtype,
                      L.add_pointwise(cast(plain, upcast(x.dtype)), x.dtype, total.shape, x.device))
    dev = Expr(Op.SUB, acc, (xs, mean))
    sq = L.add_reduction(x, dims, Op.SUM, Expr(Op.MUL, acc, (dev, dev)), acc)
    out_shape = tuple(val.shape)
    body = Expr(Op.TRUEDIV, acc, (sq.read(ir.dim_vars(len(out_shape))), ir.const(n - correction, acc)))
    return L.add_pointwise(cast(body, upcast(val.dtype)), val.dtype, out_shape, val.device, meta_layout(val))


def _spread(kept_index: list[Expr], ndim: int, dims) -> list[Expr]:
    """A full index from the index of the kept dims (the reduced ones at 0: they are unused)."""
    it = iter(kept_index)
    return [ir.const(0) if i in dims else next(it) for i in range(ndim)]


# =============================================================================
# Views: index arithmetic, no copy
# =============================================================================


def replay_layout(layout: Layout | None, view_fn, symbolic: bool = False, key: tuple | None = None) -> Layout | None:
    """The layout of a view of a tensor stored at `layout`, found by running the view on a meta
    tensor; on a fake one of the compile's ShapeEnv where sizes, or the view's (`symbolic`), are
    symbols. `key` names the view (its op and arguments): over symbols, a view of a layout is
    run once per compile (a layer repeated twelve times asks the same twelve times)."""
    if layout is None:
        return None
    symbolic = symbolic or any(map(is_symbol_size, (layout.offset, *layout.shape, *layout.stride)))
    if not symbolic or key is None:
        return _replayed_layout(layout, view_fn, symbolic)
    return compile_kept("view_layouts", (layout.key(), key), lambda: _replayed_layout(layout, view_fn, symbolic))


def _replayed_layout(layout: Layout, view_fn, symbolic: bool) -> Layout | None:
    size = 1 + layout.offset + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride) if s > 0)
    if 0 in layout.shape:
        size = layout.offset + 1
    # over symbols, a fake tensor of the compile's ShapeEnv (whose guards the view's checks record)
    with fake_mode() if symbolic else contextlib.nullcontext():
        base = torch.empty(size, device="meta").as_strided(layout.shape, layout.stride, layout.offset)
        try:
            out = view_fn(base)
        except RuntimeError:  # not expressible with strides (e.g. flattening a transpose)
            return None
    copied = out._base is not base._base if symbolic else \
        out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    if copied and out.numel() > 1:
        return None  # reshape copied
    return Layout(tuple(out.shape), tuple(out.stride()), out.storage_offset())


def make_view(node, x: BufferView, index_fn, view_fn=None, key: tuple | None = None) -> BufferView:
    """`x` seen through `index_fn` (view index -> x index); `view_fn` (with `key` naming it,
    replay_layout) the view on a tensor, else the node's op."""
    val = out_val(node)
    shape = tuple(val.shape)
    x_index = index_fn(ir.dim_vars(len(shape)))
    root_index = tuple(ir.substitute(e, x_index) for e in x.index)
    if view_fn is None:
        args = node.args[1:]
        view_fn = lambda t: node.target(t, *args, **node.kwargs)
        key = (node.target, args, node.kwargs)
    layout = replay_layout(x.layout, view_fn, any(map(is_symbol_size, shape)), key)
    return BufferView(x.root, x.dtype, shape, x.device, root_index, layout)


def reshape_index(out_index: list[Expr], in_shape, out_shape) -> list[Expr]:
    """The input index of a row-major reshape, dim group by dim group (no div/mod when dims just split)."""
    in_shape, out_shape = list(in_shape), list(out_shape)
    groups = _reshape_groups(in_shape, out_shape)
    if groups is None:
        return [ir.const(0) for _ in in_shape]
    result: list[Expr] = []
    for gi, gj in groups:
        flat = ir.flat_index([out_index[k] for k in gj], ir.contiguous_strides([out_shape[k] for k in gj]))
        result.extend(ir.unravel(flat, [in_shape[k] for k in gi]))
    return result


def _reshape_groups(in_shape: list, out_shape: list) -> list[tuple[list[int], list[int]]] | None:
    """The groups of input dims and output dims of equal products that a reshape maps onto each
    other; None for an empty tensor. Over symbols, kept for the compile (compile_kept): every
    layer of a transformer reshapes alike, and each comparison of sizes is sympy's."""
    return compile_kept("reshape_groups", (in_shape, out_shape), lambda: None if 0 in in_shape or 0 in out_shape
                        else _groups_of_equal_products(in_shape, out_shape))


def _groups_of_equal_products(in_shape: list, out_shape: list) -> list[tuple[list[int], list[int]]]:
    groups = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        # grow a group of input dims and output dims with equal products
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                pj *= out_shape[j]
                gj.append(j)
                j += 1
        groups.append(([k for k in gi if k < len(in_shape)], [k for k in gj if k < len(out_shape)]))
    return groups


@lowers(aten.view, aten._unsafe_view, aten.reshape, prims.reshape, aten.view.dtype)
def view(L, node, x, shape):
    if node.target is aten.view.dtype:
        raise NotImplementedError("view as another dtype")
    out_shape = tuple(out_val(node).shape)
    return make_view(node, x, lambda idx: reshape_index(idx, x.shape, out_shape),
                     view_fn=lambda t: t.view(out_shape), key=("view", out_shape))


@lowers(aten.permute, prims.transpose)
def permute(L, node, x, dims):
    dims = [d % len(x.shape) for d in dims]

    def index_fn(idx):
        out = [None] * len(dims)
        for k, d in enumerate(dims):
            out[d] = idx[k]
        return out

    return make_view(node, x, index_fn, view_fn=lambda t: t.permute(dims), key=("permute", dims))


@lowers(aten.transpose.int)
def transpose(L, node, x, a, b):
    n = len(x.shape)
    a, b = (a % n, b % n) if n else (0, 0)
    dims = list(range(n))
    if n:
        dims[a], dims[b] = dims[b], dims[a]
    return make_view(node, x, lambda idx: [idx[d] for d in dims], view_fn=lambda t: t.permute(dims),
                     key=("permute", dims))


@lowers(aten.expand, aten.broadcast_to)
def expand(L, node, x, sizes, implicit=False):
    shape = tuple(out_val(node).shape)
    lead = len(shape) - len(x.shape)
    return make_view(node, x, lambda idx: [ir.const(0) if s == 1 else idx[lead + k] for k, s in enumerate(x.shape)],
                     view_fn=lambda t: t.expand(shape), key=("expand", shape))


@lowers(prims.broadcast_in_dim)
def broadcast_in_dim(L, node, x, shape, broadcast_dims):
    shape = tuple(shape)

    def index_fn(idx):
        return [ir.const(0) if x.shape[k] == 1 and shape[d] != 1 else idx[d] for k, d in enumerate(broadcast_dims)]

    def view_fn(t):
        s = [1] * len(shape)
        for k, d in enumerate(broadcast_dims):
            s[d] = t.shape[k]
        return t.reshape(s).expand(shape)

    return make_view(node, x, index_fn, view_fn, key=("broadcast_in_dim", shape, broadcast_dims))


@lowers(aten.unsqueeze)
def unsqueeze(L, node, x, dim):
    dim = dim % (len(x.shape) + 1)
    return make_view(node, x, lambda idx: idx[:dim] + idx[dim + 1:], view_fn=lambda t: t.unsqueeze(dim),
                     key=("unsqueeze", dim))


@lowers(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, prims.squeeze)
def squeeze(L, node, x, dims=None):
    n = len(x.shape)
    if dims is None:
        dims = [d for d in range(n) if x.shape[d] == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = {d % n for d in dims if n and x.shape[d % n] == 1}

    def index_fn(idx):
        it = iter(idx)
        return [ir.const(0) if d in dims else next(it) for d in range(n)]

    shape = tuple(out_val(node).shape)
    return make_view(node, x, index_fn, view_fn=lambda t: t.reshape(shape) if n else t, key=("reshape", shape))


def _slice_params(size: int, start, end, step):
    if is_symbol_size(size) or is_symbol_size(start) or is_symbol_size(end):
        # Python's clamping of a slice, in comparisons of SymInts (guarded where not proven)
        def clamp(i, default):
            i = default if i is None else i + size if i < 0 else i
            return max(0, min(i, size))

        start = clamp(start, 0)
        return start, max(clamp(end, size), start)
    start, end, _ = slice(start, end, step).indices(size)
    return start, max(end, start)


@lowers(aten.slice.Tensor)
def slice_(L, node, x, dim=0, start=None, end=None, step=1):
    dim = dim % len(x.shape)
    start, _ = _slice_params(x.shape[dim], start, end, step)

    def index_fn(idx):
        idx = list(idx)
        idx[dim] = ir.iadd(ir.const(start), ir.imul(idx[dim], ir.const(step)))
        return idx

    return make_view(node, x, index_fn)


@lowers(aten.select.int)
def select(L, node, x, dim, i):
    dim = dim % len(x.shape)
    i = i % x.shape[dim]
    return make_view(node, x, lambda idx: list(idx[:dim]) + [ir.const(i)] + list(idx[dim:]))


@lowers(aten.split.Tensor, aten.split_with_sizes)
def split(L, node, x, sizes, dim=0):
    dim = dim % len(x.shape)
    outs = out_val(node)
    values, start = [], 0
    for out in outs:
        n = out.shape[dim]

        def index_fn(idx, start=start):
            idx = list(idx)
            idx[dim] = ir.iadd(idx[dim], ir.const(start))
            return idx

        shape = tuple(out.shape)
        index = tuple(ir.substitute(e, index_fn(ir.dim_vars(len(shape)))) for e in x.index)
        layout = replay_layout(x.layout, lambda t, s=start, n=n: t.narrow(dim, s, n), any(map(is_symbol_size, shape)),
                               ("narrow", dim, start, n))
        values.append(BufferView(x.root, x.dtype, shape, x.device, index, layout))
        start += n
    return values


@lowers(aten.unbind.int)
def unbind(L, node, x, dim=0):
    dim = dim % len(x.shape)
    values = []
    for i, out in enumerate(out_val(node)):
        index_fn = lambda idx, i=i: list(idx[:dim]) + [ir.const(i)] + list(idx[dim:])
        shape = tuple(out.shape)
        index = tuple(ir.substitute(e, index_fn(ir.dim_vars(len(shape)))) for e in x.index)
        layout = replay_layout(x.layout, lambda t, i=i: t.select(dim, i), key=("select", dim, i))
        values.append(BufferView(x.root, x.dtype, shape, x.device, index, layout))
    return values


# =============================================================================
# Gathers of several inputs (indices clamped so every load stays in bounds)
# =============================================================================


def clamp_index(e: Expr, lo: int, hi: int) -> Expr:
    e = Expr(Op.MAXIMUM, ir.INDEX, (e, ir.const(lo)))
    return Expr(Op.MINIMUM, ir.INDEX, (e, ir.const(hi)))


@lowers(aten.cat)
def cat(L, node, tensors, dim=0):
    val = out_val(node)
    shape = tuple(val.shape)
    dim = dim % len(shape)
    tensors = [t for t in tensors if not (len(t.shape) == 1 and t.shape[0] == 0)]
    index = ir.dim_vars(len(shape))
    compute = upcast(val.dtype)
    body, start, pieces = None, 0, []
    for t in tensors:
        n = t.shape[dim]
        if n == 0:
            continue
        idx = list(index)
        idx[dim] = clamp_index(ir.iadd(index[dim], ir.const(-start)), 0, max(n - 1, 0))
        pieces.append((start, n, cast(t.read(idx), compute)))
        start += n
    for start, n, value in reversed(pieces):
        if body is None:
            body = value
            if start > 0:  # the last input, read only past its start
                cond = Expr(Op.GE, torch.bool, (index[dim], ir.const(start)))
                body = Expr(Op.WHERE, compute, (cond, value, ir.const(0, compute)))
        else:  # the exact range of each input, so that a GPU kernel can mask its loads by it alone
            cond = Expr(Op.LT, torch.bool, (index[dim], ir.const(start + n)))
            if start > 0:
                cond = Expr(Op.LOGICAL_AND, torch.bool, (Expr(Op.GE, torch.bool, (index[dim], ir.const(start))), cond))
            body = Expr(Op.WHERE, compute, (cond, value, body))
    if body is None:
        body = ir.const(0, compute)
    return L.add_pointwise(body, val.dtype, shape, val.device, meta_layout(val))


@lowers(aten.stack)
def stack(L, node, tensors, dim=0):
    """Each input at its position along a new dimension: rotary embeddings stack a pair's
    rotated halves, then flatten them (one kernel with its producers, not a copy per input)."""
    val = out_val(node)
    shape = tuple(val.shape)
    dim = dim % len(shape)
    index = ir.dim_vars(len(shape))
    compute = upcast(val.dtype)
    inner = [*index[:dim], *index[dim + 1:]]
    body = cast(tensors[-1].read(inner), compute)
    for i in range(len(tensors) - 2, -1, -1):
        cond = Expr(Op.EQ, torch.bool, (index[dim], ir.const(i)))
        body = Expr(Op.WHERE, compute, (cond, cast(tensors[i].read(inner), compute), body))
    return L.add_pointwise(body, val.dtype, shape, val.device, meta_layout(val))


@lowers(aten.constant_pad_nd)
def constant_pad_nd(L, node, x, pad, value=0):
    val = out_val(node)
    if 0 in x.shape:
        raise NotImplementedError("padding an empty tensor")
    shape = tuple(val.shape)
    index = ir.dim_vars(len(shape))
    compute = upcast(val.dtype)
    idx, inside = list(index), None
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        before = pad[2 * k]
        shifted = ir.iadd(index[d], ir.const(-before))
        ok = Expr(Op.LOGICAL_AND, torch.bool, (
            Expr(Op.GE, torch.bool, (shifted, ir.const(0))),
            Expr(Op.LT, torch.bool, (shifted, ir.const(x.shape[d])))))
        inside = ok if inside is None else Expr(Op.LOGICAL_AND, torch.bool, (inside, ok))
        idx[d] = clamp_index(shifted, 0, max(x.shape[d] - 1, 0))
    body = cast(x.read(idx), compute)
    if inside is not None:
        body = Expr(Op.WHERE, compute, (inside, body, ir.const(value, compute)))
    return L.add_pointwise(body, val.dtype, shape, val.device, meta_layout(val))


# =============================================================================
# Externs chosen on purpose
# =============================================================================


@lowers(aten.convolution.default)
def convolution(L, node, x, weight, bias, *args):
    """Where the target asks for it, the convolution without its bias, plus a pointwise bias
    add that fuses with what follows (ReLU, the residual add): one pass over the output, not two."""
    val = out_val(node)
    if not isinstance(bias, BufferView) or not L.bias_in_kernel(val.device) or val.dim() < 2:
        raise NotImplementedError("the convolution adds its own bias")
    conv = L.extern(aten.convolution.default, (x, weight, None, *args), {}, node)
    shape = tuple(val.shape)
    index = ir.dim_vars(len(shape))
    compute = upcast(val.dtype)
    body = Expr(Op.ADD, compute, (cast(conv.read(index), compute), cast(bias.read([index[1]]), compute)))
    return L.add_pointwise(cast(body, upcast(val.dtype)), val.dtype, shape, val.device, meta_layout(val))


@lowers(aten.mm.default)
def mm(L, node, a, b):
    """On CUDA in half precision, one row times a weight read across (a decoding step's linear
    layer at batch 1) runs as runtime/decode_matvec.py's kernel: cuBLAS's took 5.7 against
    3.0 us for a Llama's 2048 x 512 key projection on the H200, 6.0 against 4.6 for 2048 x 2048.
    Only under CUDA graphs: launched from Python through Triton's launcher, each call would
    cost the host more than aten's, in a step whose host is the bottleneck without them."""
    val, a_val, b_val = out_val(node), node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if (not L.cuda_graphs or val.device.type != "cuda" or val.dtype not in (torch.float16, torch.bfloat16)
            or not isinstance(a_val, torch.Tensor) or not isinstance(b_val, torch.Tensor)
            or not _is_number(a_val.shape[0], 1) or not _is_number(b_val.stride(0), 1)):
        raise NotImplementedError("aten's own kernel")
    from torchweld.runtime import decode_matvec  # registers the op, once: CUDA only

    if isinstance(b_val.shape[1], int) and b_val.shape[1] < decode_matvec.MIN_COLUMNS:
        raise NotImplementedError("aten's own kernel: too few columns")
    return L.extern(decode_matvec.matvec, (a, b), {}, node)


def _is_number(size, number: int) -> bool:
    """Whether `size` is `number` as a plain int (a symbol is not asked: that would add a guard)."""
    return isinstance(size, int) and size == number


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(L, node, grad, indices, num_weights, padding_idx, scale_grad_by_freq=False):
    """On CUDA, a float32 embedding's weight gradient by atomic adds (`index_add_`), not aten's
    kernel for few indices: 50 us a table for GPT-2's tokens against a few (runtime/embedding_backward.py)."""
    val = out_val(node)
    if val.device.type != "cuda" or val.dtype != torch.float32 or scale_grad_by_freq:
        raise NotImplementedError("aten's own kernel")
    from torchweld.runtime import embedding_backward  # registers the op, once: CUDA only

    return L.extern(embedding_backward.embedding_dense_backward,
                    (grad, indices, num_weights, padding_idx, scale_grad_by_freq), {}, node)


def _window_reads(x: BufferView, shape, kernel, stride, padding, dilation):
    """For each position (kh, kw) of the pooling window at the output index d0..dN-1, in row
    order: (its number kh * kernel_w + kw, the input's value there (clamped into bounds),
    whether it lies inside the input: None where every output position has it inside)."""
    index = ir.dim_vars(len(shape))
    h_dim, w_dim = len(shape) - 2, len(shape) - 1
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            idx, inside = list(index), None
            for d, k in ((h_dim, kh), (w_dim, kw)):
                j = d - h_dim
                shift = k * dilation[j] - padding[j]
                pos = ir.iadd(ir.imul(index[d], ir.const(stride[j])), ir.const(shift))
                checks = []  # only the bounds some output position can cross
                if shift < 0:
                    checks.append(Expr(Op.GE, torch.bool, (pos, ir.const(0))))
                if (shape[d] - 1) * stride[j] + shift >= x.shape[d]:
                    checks.append(Expr(Op.LT, torch.bool, (pos, ir.const(x.shape[d]))))
                for ok in checks:
                    inside = ok if inside is None else Expr(Op.LOGICAL_AND, torch.bool, (inside, ok))
                idx[d] = clamp_index(pos, 0, x.shape[d] - 1) if checks else pos
            yield kh * kernel[1] + kw, x.read(idx), inside


def window_max(L, node, x: BufferView, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max pooling as a pointwise computation over the output: the maximum of the window's
    loads, positions in the padding masked to -inf. What produces `x` (batch norm and ReLU
    after a convolution) inlines into it, so that tensor is never stored. None where
    this does not apply (integer dtypes, windows of more than tuning.max_window positions)."""
    val = out_val(node)[0]
    if not val.is_floating_point() or len(x.shape) not in (3, 4):
        return None
    kernel, stride, padding, dilation = pool_offsets.pool_window(kernel_size, stride, padding, dilation)
    if kernel[0] * kernel[1] > tuning.max_window:
        return None
    shape = tuple(val.shape)
    compute = upcast(val.dtype)
    body = None
    for _, value, inside in _window_reads(x, shape, kernel, stride, padding, dilation):
        value = cast(value, compute)
        if inside is not None:
            value = Expr(Op.WHERE, compute, (inside, value, ir.const(float("-inf"), compute)))
        body = value if body is None else Expr(Op.MAXIMUM, compute, (body, value))
    return L.add_pointwise(cast(body, val.dtype), val.dtype, shape, val.device, meta_layout(val))


@lowers(pool_offsets.max_pool2d_offsets)
def max_pool2d_offsets(L, node, x, kernel_size, stride, padding, dilation, ceil_mode):
    """Each window's argmax as its position in the window, as aten's kernels pick it: a
    position replaces the best so far where its value is greater or NaN; the first position
    inside the input starts it (so a window of -inf names its first). Fused with the
    window maximum that reads the same input (runtime/pool_offsets.py)."""
    val = out_val(node)
    kernel, stride, padding, dilation = pool_offsets.pool_window(kernel_size, stride, padding, dilation)
    if len(x.shape) not in (3, 4) or kernel[0] * kernel[1] > tuning.max_window:
        raise NotImplementedError(f"windows of more than {tuning.max_window} positions")
    compute = upcast(x.dtype)
    best = offset = started = None
    for number, value, inside in _window_reads(x, tuple(val.shape), kernel, stride, padding, dilation):
        value = cast(value, compute)
        if best is None:  # the first position: inside the input wherever a window has it inside
            best, offset, started = value, ir.const(number, torch.int8), inside
            continue
        better = Expr(Op.LOGICAL_OR, torch.bool, (Expr(Op.GT, torch.bool, (value, best)),
                                                  Expr(Op.ISNAN, torch.bool, (value,))))
        if started is not None:  # no position inside yet: this one starts the window
            better = Expr(Op.LOGICAL_OR, torch.bool, (better, Expr(Op.LOGICAL_NOT, torch.bool, (started,))))
        if inside is not None:
            better = Expr(Op.LOGICAL_AND, torch.bool, (better, inside))
        best = Expr(Op.WHERE, compute, (better, value, best))
        offset = Expr(Op.WHERE, torch.int8, (better, ir.const(number, torch.int8), offset))
        if started is not None:
            started = None if inside is None else Expr(Op.LOGICAL_OR, torch.bool, (started, inside))
    return L.add_pointwise(offset, torch.int8, tuple(val.shape), val.device, meta_layout(val))


@lowers(pool_offsets.max_pool2d_backward_from_offsets)
def max_pool2d_backward_from_offsets(L, node, grad, offsets, input_size, kernel_size, stride, padding, dilation,
                                     ceil_mode):
    """The input's gradient as a pointwise computation over the input: at (h, w), the sum of
    the gradients of the outputs whose window has (h, w) at position (kh, kw) and whose
    argmax offset is that position. Such an output row is (h + padding - kh * dilation) /
    stride where that divides, inside the output (columns alike)."""
    val = out_val(node)
    kernel, stride, padding, dilation = pool_offsets.pool_window(kernel_size, stride, padding, dilation)
    if len(val.shape) not in (3, 4) or kernel[0] * kernel[1] > tuning.max_window:
        raise NotImplementedError(f"windows of more than {tuning.max_window} positions")
    shape = tuple(val.shape)
    out_shape = tuple(grad.shape)
    index = ir.dim_vars(len(shape))
    h_dim, w_dim = len(shape) - 2, len(shape) - 1
    compute = upcast(val.dtype)
    body = None
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            idx, ok = list(index), None
            for d, k in ((h_dim, kh), (w_dim, kw)):
                j = d - h_dim
                shift = padding[j] - k * dilation[j]
                shifted = ir.iadd(index[d], ir.const(shift))  # the output row times the stride
                row = ir.idiv(shifted, stride[j])
                checks = []  # only those some input position can fail
                if shift < 0:
                    checks.append(Expr(Op.GE, torch.bool, (shifted, ir.const(0))))
                if (shape[d] - 1 + shift) // stride[j] >= out_shape[d]:
                    checks.append(Expr(Op.LT, torch.bool, (row, ir.const(out_shape[d]))))
                idx[d] = clamp_index(row, 0, out_shape[d] - 1) if checks else row
                if stride[j] > 1:
                    checks.append(Expr(Op.EQ, torch.bool, (ir.imod(shifted, stride[j]), ir.const(0))))
                for check in checks:
                    ok = check if ok is None else Expr(Op.LOGICAL_AND, torch.bool, (ok, check))
            taken = Expr(Op.EQ, torch.bool, (offsets.read(idx), ir.const(kh * kernel[1] + kw, torch.int8)))
            if ok is not None:
                taken = Expr(Op.LOGICAL_AND, torch.bool, (ok, taken))
            term = Expr(Op.WHERE, compute, (taken, cast(grad.read(idx), compute), ir.const(0.0, compute)))
            body = term if body is None else Expr(Op.ADD, compute, (body, term))
    return L.add_pointwise(cast(body, val.dtype), val.dtype, shape, val.device, meta_layout(val))


@lowers(aten.max_pool2d_with_indices.default)
def max_pool2d(L, node, x, *args):
    """Inference reads only the values: a pointwise window maximum (`window_max`), or
    the aten kernel that does not compute indices."""
    import operator

    if any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
        raise NotImplementedError("the indices are used")
    pooled = window_max(L, node, x, *args)
    if pooled is not None:
        return [pooled, None]
    values = RuleNode(aten.max_pool2d.default, node.args, node.kwargs, {"val": out_val(node)[0]}, node.name)
    return [L.extern(aten.max_pool2d.default, (x, *args), {}, values), None]
