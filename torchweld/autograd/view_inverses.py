"""A write through a view, as functional aten ops: the viewed tensor's new value is its old value
with the view's elements replaced, made by each view op's inverse from the written view back to
the tensor it views (`select` -> `select_scatter`, `transpose` -> itself, `unsqueeze` -> a
reshape back), and a view taken before the write is taken again, by the same ops, of that new
value. functionalize.py rewrites an in-place op on a view of a tensor read after it into these.

The ops name elements by index, never by storage offset (an input's offset may change between
calls, and `as_strided_scatter` reads it), except an `as_strided` view, whose own arguments are
offsets: its inverse is `as_strided_scatter`, as eager's view is of the same memory.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch

from torchweld.compiler.op_effects import is_view
from torchweld.write_refusals import non_overlapping_and_dense

aten = torch.ops.aten

# view op (overload packet) -> inverse(graph, view node, the viewed tensor's value, the view's new
# value) -> the viewed tensor's new value
INVERSES: dict[object, Callable] = {}
# views whose replay on another tensor is the same view only where that tensor is laid out as the
# trace's was (strides or offsets): allowed where the viewed tensor is dense
NEED_DENSE = frozenset({aten.view, aten._unsafe_view, aten.reshape, aten.as_strided})


def inverse_of(*ops):
    def register(fn):
        for op in ops:
            assert op not in INVERSES, op
            INVERSES[op] = fn
        return fn
    return register


def call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict, like: torch.fx.Node) -> torch.fx.Node:
    """A new node `target(*args, **kwargs)` with `like`'s metadata: a scatter's result is laid out
    as the tensor it writes into (`like`); a view op's "val" is that view of its one tensor's
    (the trace's fake tensors; a scatter's two may come from different fake modes)."""
    node = graph.call_function(target, args, kwargs)
    node.meta = dict(like.meta)
    if is_view(node):
        node.meta["val"] = target(args[0].meta["val"], *args[1:], **kwargs)
    return node


@inverse_of(aten.select)
def _select(graph, view, base, new):
    return call(graph, aten.select_scatter.default, (base, new, *view.args[1:]), view.kwargs, like=base)


@inverse_of(aten.slice)
def _slice(graph, view, base, new):
    return call(graph, aten.slice_scatter.default, (base, new, *view.args[1:]), view.kwargs, like=base)


@inverse_of(aten.diagonal)
def _diagonal(graph, view, base, new):
    return call(graph, aten.diagonal_scatter.default, (base, new, *view.args[1:]), view.kwargs, like=base)


@inverse_of(aten.as_strided)
def _as_strided(graph, view, base, new):
    return call(graph, aten.as_strided_scatter.default, (base, new, *view.args[1:]), view.kwargs, like=base)


@inverse_of(aten.transpose)
def _transpose(graph, view, base, new):
    return call(graph, aten.transpose.int, (new, *view.args[1:]), view.kwargs, like=base)


@inverse_of(aten.t)
def _t(graph, view, base, new):
    return call(graph, aten.t.default, (new,), {}, like=base)


@inverse_of(aten.permute)
def _permute(graph, view, base, new):
    dims = [d % len(view.args[1]) for d in view.args[1]]
    return call(graph, aten.permute.default, (new, sorted(range(len(dims)), key=dims.__getitem__)), {}, like=base)


@inverse_of(aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze)
def _reshaped(graph, view, base, new):
    return call(graph, aten.reshape.default, (new, list(base.meta["val"].shape)), {}, like=base)


@inverse_of(aten.alias, aten.detach)
def _alias(graph, view, base, new):
    return new


def _multi_view_element(graph, view, base, new):
    """One element of split's or unbind's views: a slice or a select of the tensor they split."""
    multi, i = view.args
    packet = multi.target.overloadpacket
    if packet is aten.unbind:
        dim = multi.args[1] if len(multi.args) > 1 else multi.kwargs.get("dim", 0)
        return call(graph, aten.select_scatter.default, (base, new, dim, i), {}, like=base)
    dim = multi.args[2] if len(multi.args) > 2 else multi.kwargs.get("dim", 0)
    sizes = [t.shape[dim] for t in multi.meta["val"]]
    start = sum(sizes[:i])
    return call(graph, aten.slice_scatter.default, (base, new, dim, start, start + sizes[i]), {}, like=base)


MULTI_VIEWS = frozenset({aten.split, aten.split_with_sizes, aten.unbind})


def is_view_node(node: torch.fx.Node) -> bool:
    """A view op's result, or one of the views a multi-view op made (split's, unbind's getitems)."""
    return is_view(node) or (node.op == "call_function" and node.target is operator.getitem
                             and isinstance(node.args[0], torch.fx.Node) and is_view(node.args[0]))


def viewed(view: torch.fx.Node) -> torch.fx.Node:
    """The tensor `view` (a view, or a getitem of a multi-view op) views."""
    return view.args[0].args[0] if view.target is operator.getitem else view.args[0]


def chain(view: torch.fx.Node, stop=frozenset()) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(the tensor `view` views through views, the views from it to `view`, in order); a node in
    `stop` counts as a tensor of its own (a written tensor's new value that `scatter` made, which
    may be a view of another value: `transpose`'s inverse)."""
    nodes = []
    while is_view_node(view) and view not in stop:
        nodes.append(view)
        view = viewed(view)
    return view, nodes[::-1]


def why_not_invertible(base: torch.fx.Node, views: list[torch.fx.Node]) -> str | None:
    """Why a write through the chain `views` of `base` cannot be made functional; None if it can."""
    val = base.meta.get("val")
    dense = isinstance(val, torch.Tensor) and val.layout is torch.strided \
        and non_overlapping_and_dense(tuple(val.shape), tuple(val.stride()))
    for view in views:
        packet = _packet(view)
        if view.target is aten.view.dtype or (packet not in INVERSES and packet not in MULTI_VIEWS):
            return f"{view.name} is a view ({packet}) weld cannot write back through"
        if packet in NEED_DENSE and not dense:
            return f"{view.name} ({packet}) views {base.name}, whose memory has gaps or overlaps"
    return None


def scatter(graph: torch.fx.Graph, views: list[torch.fx.Node], base_value: torch.fx.Node,
            new_view: torch.fx.Node) -> torch.fx.Node:
    """`base_value` with the elements that the chain of views `views` reaches replaced by `new_view`'s."""
    values = [base_value]
    for view in views[:-1]:
        values.append(replay(graph, view, values[-1]))
    new = new_view
    for view, value in zip(reversed(views), reversed(values)):
        inverse = _multi_view_element if view.target is operator.getitem else INVERSES[_packet(view)]
        new = inverse(graph, view, value, new)
    return new


def view_again(graph: torch.fx.Graph, views: list[torch.fx.Node], new_base: torch.fx.Node) -> torch.fx.Node:
    """The last of the chain of views `views`, taken again of `new_base`."""
    value = new_base
    for view in views:
        value = replay(graph, view, value)
    return value


def replay(graph: torch.fx.Graph, view: torch.fx.Node, value: torch.fx.Node) -> torch.fx.Node:
    """`view`'s op, taken of `value` instead of what it viewed."""
    if view.target is operator.getitem:
        multi, i = view.args
        again = graph.call_function(multi.target, (value, *multi.args[1:]), dict(multi.kwargs))
        again.meta = dict(multi.meta)
        item = graph.call_function(operator.getitem, (again, i))
        item.meta = dict(view.meta)
        return item
    again = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
    again.meta = dict(view.meta)
    return again


def _packet(view: torch.fx.Node):
    target = view.args[0].target if view.target is operator.getitem else view.target
    return target.overloadpacket
