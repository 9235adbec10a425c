"""Which tensors of an aten graph share memory, and where an element of one sits in the
other: what the lowering needs to carry an in-place write through a view to its base, to
every other view of that base, and back into a graph input.

A view's place in its base is read off the trace's fake tensors, which share storage as
the real ones do: its sizes, strides and storage offset against the base's. An element
of the view at index v is the element of the base at the same storage offset, so

    base element at e  <->  view element at v   where   offset_base(e) == offset_view(v)

and either index follows from the other by unflattening an offset over a layout's
strides, largest first (`unflatten`). That holds for every view whose strides nest (each
larger than the span of the smaller ones under it): slices, selects, transposes,
reshapes, diagonals, and the as_strided views of them that do not overlap.
"""
from __future__ import annotations

import operator

import torch

from torchweld.compiler import ir
from torchweld.compiler.ir import Expr, Layout, Op
from torchweld.compiler.op_effects import is_view, mutates
from torchweld.write_refusals import overlap_refusal


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node`'s tensor is: `node` itself, or, for a view, an element
    of a multi-result view (split's getitem) or the result of an in-place op (which
    returns its first argument), that argument's base."""
    while node.op == "call_function":
        first = node.args[0] if node.args else None
        if not isinstance(first, torch.fx.Node):
            return node
        if is_view(node) or (mutates(node) and _returns_first_argument(node)):
            node = first
        elif node.target is operator.getitem and is_view(first):
            node = first
        else:
            return node
    return node


def tensor_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor object `node`'s is: through in-place ops, which return their first
    argument itself (`x.add_(1).mul_(2)` is x), not through views, which are new tensors."""
    while node.op == "call_function" and mutates(node) and _returns_first_argument(node) \
            and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _returns_first_argument(node: torch.fx.Node) -> bool:
    returns = node.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write


def write_eager_refuses(node: torch.fx.Node) -> str | None:
    """Eager's error for the in-place op `node` (checks aten makes before its kernel runs, which
    the trace's fake tensors do not) where the trace's tensors show one: a pointwise result of a
    type the written tensor cannot hold (`int_tensor.mul_(0.5)`), a written tensor with elements
    that share memory (an expanded view), or sharing memory in part with another argument
    (`x.add_(x[0])`); None where eager's kernel runs. A graph holding such a write runs as
    captured, so that the error is eager's."""
    written = fake_of(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if written is None:
        return None
    result = _result_dtype(node, written)
    if result is not None and not torch.can_cast(result, written.dtype):
        return f"result type {result} can't be cast to the desired output type {written.dtype}"
    others: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return overlap_refusal(written, [fake_of(other) for other in others])


def _result_dtype(node: torch.fx.Node, written: torch.Tensor) -> torch.dtype | None:
    """The dtype a pointwise in-place op computes in (type promotion of its operands), or None."""
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return None
    result = written.dtype
    for arg in node.args[1:]:
        other = fake_of(arg) if isinstance(arg, torch.fx.Node) else arg
        if isinstance(other, (torch.Tensor, bool, int, float, complex)):
            result = torch.promote_types(result, torch.result_type(written, other))
    return result


def fake_of(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) and val.layout is torch.strided else None


def own_layout(node: torch.fx.Node) -> Layout | None:
    """The layout of `node`'s tensor at its own storage offset (0)."""
    val = fake_of(node)
    return None if val is None else Layout(tuple(val.shape), tuple(val.stride()))


def layout_in(val: torch.Tensor | None, base_val: torch.Tensor | None) -> Layout | None:
    """The layout of the (fake) tensor `val` in the memory of `base_val`: its sizes and
    strides, and its storage offset less base's; None where they do not share storage."""
    if not isinstance(val, torch.Tensor) or not isinstance(base_val, torch.Tensor) \
            or not _same_storage(val, base_val):
        return None
    return Layout(tuple(val.shape), tuple(val.stride()), val.storage_offset() - base_val.storage_offset())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return False


def nested(layout: Layout) -> bool:
    """Whether each stride of `layout` (sizes above 1, largest stride first) is larger than
    the furthest offset the dims under it reach: every offset is then one element's, found
    by `unflatten` (no two elements share one)."""
    reach = 0
    for size, stride in sorted(((s, st) for s, st in zip(layout.shape, layout.stride) if s > 1),
                               key=lambda p: p[1]):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def unflatten(offset: Expr, layout: Layout) -> tuple[list[Expr], Expr] | None:
    """(the index of the element of `layout` at storage offset `offset`, clamped into its
    shape, and a bool Expr: whether that element is there at all); None unless `nested`."""
    if not nested(layout) or 0 in layout.shape:
        return None
    rest = ir.iadd(offset, ir.const(-layout.offset))
    inside = Expr(Op.GE, torch.bool, (rest, ir.const(0)))
    index: list[Expr] = [ir.const(0)] * len(layout.shape)
    dims = sorted((d for d, s in enumerate(layout.shape) if s > 1), key=lambda d: -layout.stride[d])
    for d in dims:
        size, stride = layout.shape[d], layout.stride[d]
        digit = ir.idiv(rest, stride)
        inside = _and(inside, Expr(Op.LT, torch.bool, (digit, ir.const(size))))
        index[d] = _clamp(digit, size - 1)
        rest = ir.imod(rest, stride) if stride != 1 else ir.const(0)
    if not ir.is_const(rest, 0):
        inside = _and(inside, Expr(Op.EQ, torch.bool, (rest, ir.const(0))))
    return index, inside


def view_index(base: Layout, view: Layout) -> list[Expr] | None:
    """For each element of a view (over its dims d0..), the index of the same element in its
    base; both layouts in the base's memory."""
    offset = ir.flat_index(ir.dim_vars(len(view.shape)), view.stride, view.offset)
    found = unflatten(offset, Layout(base.shape, base.stride))
    return None if found is None else found[0]


def scatter_index(base: Layout, view: Layout) -> tuple[list[Expr], Expr] | None:
    """For each element of a base (over its dims d0..), the index of the same element in a
    view of it, and whether the view holds it at all."""
    offset = ir.flat_index(ir.dim_vars(len(base.shape)), base.stride, base.offset)
    return unflatten(offset, view)


def _and(a: Expr, b: Expr) -> Expr:
    return Expr(Op.LOGICAL_AND, torch.bool, (a, b))


def _clamp(e: Expr, hi: int) -> Expr:
    """`e` within 0..hi: a load at it stays in bounds where its element is not there."""
    if ir.is_const(e):
        return ir.const(min(max(e.arg, 0), hi))
    e = Expr(Op.MAXIMUM, ir.INDEX, (e, ir.const(0)))
    return Expr(Op.MINIMUM, ir.INDEX, (e, ir.const(hi)))
