"""Rewrite an aten graph without in-place ops: each `op_(x, ...)` becomes its
functional variant `y = op(x, ...)`, later readers of `x` read `y`, and a
mutated placeholder's final value becomes an extra graph output that the
runtime copies back into the real tensor after the forward."""
from __future__ import annotations

import dataclasses
import operator

import torch

from torchweld.compiler.aten_graph import pure_overload
from torchweld.compiler.op_effects import is_view, mutates

aten = torch.ops.aten


class FunctionalizationError(Exception):
    """This graph mutates something we cannot express functionally (a view, an out= argument)."""


def functional_variant(target: torch._ops.OpOverload) -> torch._ops.OpOverload:
    overload = pure_overload(target)
    if overload is None:
        raise FunctionalizationError(f"{target} mutates its input and has no functional variant")
    return overload


def mutated_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node an in-place op writes, or None for a pure op; refuses ops writing anything else."""
    if not mutates(node):
        return None
    t = node.target
    written = [i for i, a in enumerate(t._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if written != [0] or not isinstance(node.args[0], torch.fx.Node):
        raise FunctionalizationError(f"{t} writes arguments {written}; only in-place ops on `self` are supported")
    return node.args[0]


@dataclasses.dataclass
class Functionalized:
    """The pure graph, and for each mutated placeholder (by position) the output index of its new value."""

    gm: torch.fx.GraphModule
    mutated_placeholders: list[int]  # placeholder position, in output order after the original outputs


def functionalize(gm: torch.fx.GraphModule) -> Functionalized:
    """Rewrite `gm` in place: in-place ops become pure ones; mutated placeholders get outputs appended.

    The original outputs stay a flat list (the caller traced them flat), with the
    new values of mutated placeholders appended in placeholder order."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    current: dict[torch.fx.Node, torch.fx.Node] = {}  # a mutated node -> the node holding its value now
    root: dict[torch.fx.Node, torch.fx.Node] = {}  # a pure node -> the node it rewrote in place
    latest = lambda a: current.get(a, a) if isinstance(a, torch.fx.Node) else a
    for node in nodes:
        if node.op == "output":
            break
        if node.op != "call_function":
            continue
        node.args = torch.fx.node.map_arg(node.args, latest)
        node.kwargs = torch.fx.node.map_arg(node.kwargs, latest)
        base = mutated_argument(node)
        if base is None:
            continue
        original = root.get(base, base)
        scattered = None  # the base an as_strided view writes through, when its base is read later
        if is_view(original) and not _only_view_read_later(original, node, position):
            scattered = _strided_base(original)
            if scattered is None:
                raise FunctionalizationError(f"in-place {node.target} on a view ({original.name}) is not supported")
            _check_no_stale_views(scattered, node, position, allowed=original)
        if original.op == "call_function" and original.target is operator.getitem \
                and not isinstance(original.meta.get("val"), torch.Tensor):
            raise FunctionalizationError(f"in-place {node.target} on {original.name} is not supported")
        _check_no_stale_views(original, node, position)
        with graph.inserting_before(node):
            pure = graph.call_function(functional_variant(node.target), *_with_defaults(node))
            if scattered is not None:  # the base's new value: the view's elements written into it
                new_base = graph.call_function(aten.as_strided_scatter.default,
                                               (latest(scattered), pure, *original.args[1:]))
                new_base.meta = dict(scattered.meta)
                position[new_base] = position[node]
        pure.meta = dict(node.meta)
        position[pure] = position[node]
        root[pure] = original
        node.replace_all_uses_with(pure)
        graph.erase_node(node)
        for k, v in list(current.items()):
            if v is base:
                current[k] = pure
        current[original] = pure
        current[base] = pure
        if scattered is not None:
            current[scattered] = new_base
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0])
    flat = [latest(a) for a in flat]
    mutated = [i for i, p in enumerate(placeholders) if p in current]
    output.args = (flat + [current[placeholders[i]] for i in mutated],)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return Functionalized(gm, mutated)


def _with_defaults(node: torch.fx.Node) -> tuple[tuple, dict]:
    """The node's arguments with positional defaults spelled out (`bernoulli_(x)` -> `bernoulli(x, 0.5)`)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    for a in node.target._schema.arguments[len(args):]:
        if a.kwarg_only:
            break
        if a.name in kwargs:
            args.append(kwargs.pop(a.name))
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            break
    return tuple(args), kwargs


def _strided_base(view: torch.fx.Node) -> torch.fx.Node | None:
    """The base `view` is an `as_strided` of, when an as_strided_scatter can write it back."""
    if view.target is aten.as_strided.default and isinstance(view.args[0], torch.fx.Node) \
            and not is_view(view.args[0]) and isinstance(view.args[0].meta.get("val"), torch.Tensor):
        return view.args[0]
    return None


def _check_no_stale_views(base: torch.fx.Node, mutation: torch.fx.Node, position: dict,
                          allowed: torch.fx.Node | None = None) -> None:
    """Refuse when a view of `base` taken before `mutation` is read after it (it would see the write);
    `allowed` is the view being written, whose later readers are given its new value."""
    stack = [u for u in base.users if is_view(u) and u is not allowed and position.get(u, 0) < position[mutation]]
    while stack:
        view = stack.pop()
        for user in view.users:
            if position.get(user, -1) > position[mutation]:
                raise FunctionalizationError(
                    f"{view.name}, a view of {base.name}, is read after {mutation.target} writes {base.name}")
            if is_view(user):
                stack.append(user)


def _only_view_read_later(view: torch.fx.Node, mutation: torch.fx.Node, position: dict) -> bool:
    """Whether writing `view` in place is the same as rebinding it: its base is an
    intermediate (not an input) that nothing but `view` reaches after `mutation`
    (batch norm's decomposition, say, returns an as_strided view of a fresh result
    that an in-place ReLU then writes)."""
    base = view
    while is_view(base):
        base = base.args[0]
    if base.op != "call_function":
        return False  # a view of an input: the write must reach the input
    stack, seen = [base], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user is view or user is mutation:
                continue
            if user.op == "output" or position.get(user, -1) > position[mutation]:
                return False
            if is_view(user):
                stack.append(user)
    return True
