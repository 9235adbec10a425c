"""Common subexpression elimination on a pure aten graph.

Models repeat work that eager mode cannot share: every attention layer of GPT-2
turns the same boolean causal mask into the same float bias inside
`scaled_dot_product_attention`, and autograd's backward rebuilds the same
constants and broadcasts once per use. Traced into one graph, such nodes have the
same target and the same arguments; this pass keeps the first and points the
others' readers at it. In a training graph that is one saved tensor where there
were twelve (GPT-2: 22 MiB), and fewer kernels to generate and launch anywhere.

What never merges:
- ops that return anything but tensors (a profiler range's handle, `.item()`'s number)
  or nothing (`_assert_async`): two calls there are two events;
- ops drawing random numbers (`nondeterministic_seeded`: `rand_like`, `bernoulli`):
  two draws are two different tensors;
- in-place ops, any tensor an in-place op writes (through views too: two fresh
  `zeros` that two layers' caches are made of stay two tensors), and any node that
  reads one: two equal reads on either side of the write see two different values (a
  KV cache updated by `index_copy_`; a training graph is functionalized first). The rest of
  such a graph merges as any graph does: the causal mask's float bias is made once for
  a decoder's 16 layers, not per layer;
- a node the graph returns, or a base a returned view reads: two outputs of the
  graph stay two tensors, as eager returned them (one would be written through
  the other, `.grad` accumulation among them). Such a node may still be the one
  kept, for later equal nodes that are not returned.
"""
from __future__ import annotations

import operator

import torch

from torchweld.compiler.op_effects import is_random, is_view, mutates, returned_storage

_TENSOR_TYPES = frozenset({"Tensor", "List[Tensor]", "Optional[Tensor]"})  # what a mergeable op returns


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> int:
    """Merge equal pure nodes of `graph` in place (see the module docstring); returns how many
    nodes were removed."""
    written = _written_storage(graph)
    returned = returned_storage(graph)
    first: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        key = _key(node)
        if key is None or node in written or any(a in written for a in node.all_input_nodes):
            continue
        kept = first.get(key)
        if kept is None:
            first[key] = node
        elif node not in returned:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            removed += 1
    return removed


def _written_storage(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose tensors share memory with one an in-place op writes: the written
    tensor, the bases it is a view of, and every view of those (the in-place op's own result)."""
    written = {a for n in graph.nodes if mutates(n) for a in _written_arguments(n)}
    if not written:
        return set()
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for node in graph.nodes:  # aliases: a view of its first input, an in-place op's result, getitem
        if (is_view(node) or mutates(node) or node.target is operator.getitem) and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            parent[root(node)] = root(node.args[0])
    roots = {root(n) for n in written}
    return {n for n in graph.nodes if root(n) in roots}


def _written_arguments(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments an in-place or out= node writes (`Tensor(a!)` in its schema)."""
    schema = node.target._schema
    by_name = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    out = []
    for argument in schema.arguments:
        value = by_name.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]
    return out


def _key(node: torch.fx.Node) -> tuple | None:
    """What makes two nodes equal (target, arguments), or None where `node` may not merge."""
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        if is_random(node) or not _returns_tensors(t):
            return None
    elif t is not operator.getitem:
        return None
    try:
        key = (t, _literal(node.args), _literal(tuple(sorted(node.kwargs.items()))))
        hash(key)
    except TypeError:  # an argument without a value identity (a tensor literal, a list of them)
        return None
    return key


def _returns_tensors(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(str(r.type) in _TENSOR_TYPES for r in returns)


def _literal(value) -> object:
    """`value` as a hashable key in which 1, 1.0, True and -0.0, 0.0 stay apart (they hash and
    compare equal in Python, but `add(x, 1)` and `add(x, 1.0)` differ in their result type)."""
    if isinstance(value, (tuple, list)):
        return (type(value) is tuple, tuple(_literal(v) for v in value))
    if isinstance(value, float):
        return (float, repr(value))
    if isinstance(value, (bool, int)):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor literal")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # (hashing one would fix its value)
        return (type(value), value.node.expr)
    return value
