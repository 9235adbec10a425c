"""Concatenations that extend an earlier one read it, not all of its inputs again.

A DenseNet block concatenates its features anew for every layer: layer k's input is
`cat([x0, ..., xk])`, and layer k+1's `cat([x0, ..., xk, xk+1])`. Lowered as they are,
each is a pointwise body choosing among k+1 inputs, so each layer's kernel has a different
number of pointers: densenet121's inference graph had 58 such kernels, all different, of
5 to 29 inputs each, and the longest Triton compiles (over a second each).

This pass rewrites `cat([x0, ..., xk+1])` as `cat([c, xk+1])` where the graph already
computes `c = cat([x0, ..., xk])`, the longest such prefix. Then `c` is read twice and is
stored (as eager stores every concatenation), in the kernel that computes it anyway, and
every layer's kernel has the same inputs, differing only in sizes: the kernels of a block
are a family (compiler/codegen/size_args.py) that compiles a few times, not once a layer.
The weld backend runs it on the captured graph (`torch.cat`), so that in training the
backward slices one gradient after another instead of summing a slice of every later
layer's; it works on aten graphs (`aten.cat`) too.

    n = chain_concatenations(gm)   # the number of concatenations rewritten, in place
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
CATS = (torch.cat, aten.cat.default)


def chain_concatenations(gm: torch.fx.GraphModule) -> int:
    seen: dict[tuple, torch.fx.Node] = {}  # (inputs, dim) -> the cat node of those inputs
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in CATS or not isinstance(node.args[0], (list, tuple)):
            continue
        if set(node.kwargs) - {"dim"}:
            continue  # `out=`, or the `axis=` spelling: left as written
        tensors = list(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(dim, int) or not _chainable(node, tensors):
            continue
        dim %= _value(node).dim()
        for end in range(len(tensors) - 1, 1, -1):
            prefix = seen.get((tuple(tensors[:end]), dim))
            if prefix is not None:
                node.args = ([prefix, *tensors[end:]], dim)
                node.kwargs = {}
                rewritten += 1
                break
        seen[(tuple(tensors), dim)] = node
    if rewritten:
        gm.recompile()
    return rewritten


def _value(node) -> object:
    """A node's example value: "val" in aten graphs, "example_value" in captured ones."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _chainable(node: torch.fx.Node, tensors: list) -> bool:
    """Inputs all nodes of the output's dtype and rank (no type promotion, no legacy empty 1-d inputs)."""
    out = _value(node)
    if not isinstance(out, torch.Tensor) or len(tensors) < 2:
        return False
    for t in tensors:
        val = _value(t)
        if not isinstance(val, torch.Tensor) or val.dtype != out.dtype or val.dim() != out.dim():
            return False
    return True
