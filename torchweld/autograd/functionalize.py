"""Rewrite an aten graph without in-place ops: each `op_(x, ...)` becomes its
functional variant `y = op(x, ...)`, later readers of `x` read `y`, and a
mutated placeholder's final value becomes an extra graph output that the
runtime copies back into the real tensor after the forward."""
from __future__ import annotations

import dataclasses
import operator

import torch

from torchweld.autograd import view_inverses
from torchweld.compiler import aliasing
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
    stands_for: dict[torch.fx.Node, torch.fx.Node] = {}  # a written base's new value -> the base
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
        refused = aliasing.write_eager_refuses(node)
        if refused is not None:
            raise FunctionalizationError(f"eager's {node.target} raises here ({refused})")
        original = root.get(base, base)
        target = functional_variant(node.target)
        # a write of data (not `unsqueeze_`'s of metadata) through a view of a tensor read later:
        # (that tensor, the chain of views to the written one)
        scattered = None
        if view_inverses.is_view_node(original) and not is_view_op(target) \
                and not _only_view_read_later(original, node, position, stands_for, root):
            view_base, views = view_inverses.chain(original, stop=stands_for.keys())
            why = view_inverses.why_not_invertible(view_base, views)
            if why is not None:
                raise FunctionalizationError(f"in-place {node.target} on a view ({original.name}): {why}")
            scattered = (view_base, views)
            holders = _holders(view_base, current, stands_for)
        else:
            holders = _holders(base, current, stands_for) | {original}
        if original.op == "call_function" and original.target is operator.getitem \
                and not isinstance(original.meta.get("val"), torch.Tensor):
            raise FunctionalizationError(f"in-place {node.target} on {original.name} is not supported")
        stale = {}  # views taken before this write of data and read after it, with those later readers
        for holder in [*holders, original] if not is_view_op(target) else ():
            stale.update(_stale_views(holder, node, position, allowed=original))
        with graph.inserting_before(node):
            pure = graph.call_function(target, *_with_defaults(node))
            pure.meta = dict(node.meta)
            position[pure] = position[node]
            if scattered is not None:  # the viewed tensor's new value: the view's elements written into it
                new_base = view_inverses.scatter(graph, scattered[1], latest(scattered[0]), pure)
                stands_for[new_base] = scattered[0]
            if stale:
                _view_again(graph, stale, new_base if scattered is not None else pure, node, position, stands_for)
        root[pure] = original
        node.replace_all_uses_with(pure)
        graph.erase_node(node)
        for k, v in list(current.items()):
            if v is base:
                current[k] = pure
        current[original] = pure
        current[base] = pure
        if scattered is not None:  # the viewed tensor, by whichever node holds its value now, is the new base
            for k, v in list(current.items()):
                if v is scattered[0]:
                    current[k] = new_base
            current[scattered[0]] = new_base
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


def _holders(node: torch.fx.Node, current: dict, stands_for: dict) -> set[torch.fx.Node]:
    """The nodes that held the value of the tensor `node` holds now, before earlier writes to it:
    views taken of them before this write may be read after it."""
    found = {node} | {k for k, v in current.items() if v is node}
    while node in stands_for:
        node = stands_for[node]
        found.add(node)
    return found


def _stale_views(base: torch.fx.Node, mutation: torch.fx.Node, position: dict,
                 allowed: torch.fx.Node | None = None) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """The views of `base` taken before `mutation` and read after it (which must see the write),
    each with those later readers; `allowed` is the view being written, whose later readers
    are given its new value."""
    stale = {}
    stack = [u for u in base.users if view_inverses.is_view_node(u) and u is not allowed and position.get(u, 0) < position[mutation]]
    seen = set()
    while stack:
        view = stack.pop()
        if view in seen:
            continue
        seen.add(view)
        later = [user for user in view.users if user is not allowed and position.get(user, -1) > position[mutation]]
        if later:
            stale[view] = later
        stack.extend(user for user in view.users if user is not allowed and view_inverses.is_view_node(user)
                     and position.get(user, -1) < position[mutation])
    return stale


def _view_again(graph: torch.fx.Graph, stale: dict, new_value: torch.fx.Node, mutation: torch.fx.Node,
                position: dict, stands_for: dict) -> None:
    """Each stale view's later readers read the same view, taken again by the same ops, of the
    written tensor's new value (view_inverses.view_again)."""
    for view, later in stale.items():
        base, views = view_inverses.chain(view, stop=stands_for.keys())
        why = view_inverses.why_not_invertible(base, views)
        if why is not None:
            raise FunctionalizationError(f"{view.name}, a view of {base.name}, is read after {mutation.target} "
                                         f"writes {base.name} ({why})")
        again = view_inverses.view_again(graph, views, new_value)
        position[again] = position[mutation]
        for user in later:
            user.replace_input_with(view, again)


def _only_view_read_later(view: torch.fx.Node, mutation: torch.fx.Node, position: dict,
                          stands_for: dict[torch.fx.Node, torch.fx.Node],
                          root: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Whether writing `view` in place is the same as rebinding it: its base is an
    intermediate (not an input) that nothing but `view` reaches after `mutation`
    (batch norm's decomposition, say, returns an as_strided view of a fresh result
    that an in-place ReLU then writes). `stands_for`: a base made by an earlier write
    through a view -> the node it is the new value of, which later readers still name;
    `root`: a base made by an earlier write of the tensor itself -> the node it rewrote
    (`T.clamp_()` then `T.view(2, 2).add_(1)`: the view's base is T's new value, an
    input's, which the write must reach)."""
    base, _ = view_inverses.chain(view, stop=stands_for.keys())
    bases = [base]
    while True:
        earlier = stands_for.get(bases[-1], root.get(bases[-1]))
        if earlier is None or earlier in bases:
            break
        bases.append(earlier)
    if any(b.op != "call_function" for b in bases):
        return False  # a view of an input: the write must reach the input
    stack, seen = list(bases), set()
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
            if view_inverses.is_view_node(user):
                stack.append(user)
    return True


def is_view_op(target: torch._ops.OpOverload) -> bool:
    """Does the aten op `target` return a view of its first argument (`unsqueeze`: its in-place
    form, `unsqueeze_`, changes the tensor's metadata, not its data)?"""
    returns = target._schema.returns
    return not target._schema.is_mutable and bool(returns) and returns[0].alias_info is not None
