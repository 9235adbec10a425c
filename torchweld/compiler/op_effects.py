"""What an aten node's schema says about its effects: whether it returns a view of its
input, writes one of its inputs, or draws random numbers; and which nodes' tensors a
graph returns. Passes that move, merge or precompute nodes (CSE, constant folding, the
partitioner's recompute, the lowering's shared reductions) ask here."""
from __future__ import annotations

import operator

import torch


def is_view(node: torch.fx.Node) -> bool:
    """Does `node` return an alias of its first input (view, detach, transpose, ...)?"""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    returns = t._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def mutates(node: torch.fx.Node) -> bool:
    """Does `node` write one of its inputs (an in-place op, an out= variant)?"""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def is_random(node: torch.fx.Node) -> bool:
    """Does `node` draw random numbers (`rand_like`, `bernoulli`: two calls, two results)?"""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def returned_storage(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose tensors the graph returns: the outputs, and the bases their views
    (and getitems) read. Two of them must stay two tensors, as eager returned them."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    stack = list(output.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_view(node) or node.target is operator.getitem:
            stack.extend(a for a in node.args[:1] if isinstance(a, torch.fx.Node))
    return seen
