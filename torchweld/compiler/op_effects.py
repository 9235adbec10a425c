"""What an aten node's schema says about its effects: whether it returns a view of its
input, writes one of its inputs, or draws random numbers. Passes that move, merge or
precompute nodes (CSE, constant folding, the partitioner's recompute) ask here."""
from __future__ import annotations

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
