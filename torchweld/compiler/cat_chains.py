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

A concatenation of one tensor and legacy empty 1-d tensors (which cat skips) is that tensor:
transformers' DynamicCache starts each layer's keys and values as `torch.tensor([])` and
concatenates the step's onto them, a copy of each, contiguous in (batch, heads, positions,
features), where the tensor itself is a view of the q/k/v projection's rows that attention
reads as it is. GPT-2's bf16 autocast training step (b8 s1024, H200): 12 fewer kernels, GPU
busy time 21.20 -> 21.00 ms a step, peak memory 4566 -> 4261 MiB. The empty tensors still take
part in the result's dtype (`torch.tensor([])` is float32: a bf16 key becomes float32, as
eager's does); the rewrite is `x.to(dtype)` then.

    n = drop_empty_concatenations(gm)   # the number rewritten, in place

It rewrites only where nothing could tell the difference: the result is no output of the graph,
the graph writes nothing in place, and every user of the result gives the same result whatever
its strides (a matrix product, attention reading it as key or value).
"""
from __future__ import annotations

import operator

import torch

from torchweld.node_effects import writes_first_argument

aten = torch.ops.aten
CATS = (torch.cat, aten.cat.default)
# users whose result is laid out alike whatever the strides of the tensor they read (matrix
# products return contiguous results; attention lays its output out by its query's, so it reads
# a key or value in place, not a query)
_PRODUCTS = frozenset({torch.matmul, operator.matmul, torch.bmm})
_ATTENTION = frozenset({torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})


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


def drop_empty_concatenations(gm: torch.fx.GraphModule) -> int:
    if _writes_in_place(gm):
        return 0
    outputs = set().union(*(_flat_nodes(n.args) for n in gm.graph.nodes if n.op == "output"))
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat or set(node.kwargs) - {"dim"} \
                or not isinstance(node.args[0], (list, tuple)) or node in outputs:
            continue
        out = _value(node)
        kept = [t for t in node.args[0] if not _legacy_empty(_value(t))]
        if not isinstance(out, torch.Tensor) or len(kept) != 1 or not isinstance(kept[0], torch.fx.Node):
            continue
        if not _reads_values_only(node):
            continue
        (x,) = kept
        if _value(x).dtype == out.dtype:
            node.replace_all_uses_with(x)
        else:
            with gm.graph.inserting_after(node):
                converted = gm.graph.call_method("to", (x, out.dtype))
            converted.meta["example_value"] = _value(x).to(out.dtype)
            node.replace_all_uses_with(converted)
        empties = [t for t in node.args[0] if t is not x]
        gm.graph.erase_node(node)
        for empty in empties:  # (`torch.tensor([])`, read by nothing else now)
            if isinstance(empty, torch.fx.Node) and empty.op == "call_function" and not empty.users:
                gm.graph.erase_node(empty)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _reads_values_only(node: torch.fx.Node) -> bool:
    """Whether every user of `node` gives the same result, strides too, whatever `node`'s strides:
    a matrix product, attention over it as key or value, or a dtype conversion (which keeps
    the layout) whose users do."""
    for user in node.users:
        if user.op == "call_function" and user.target in _PRODUCTS:
            continue
        if user.op == "call_function" and user.target in _ATTENTION and node not in (user.args[:1] or [user.kwargs.get("query")]):
            continue
        if user.op == "call_method" and user.target == "to" and user.args[0] is node and _reads_values_only(user):
            continue
        return False
    return True


def _legacy_empty(value) -> bool:
    """A 1-d tensor of no elements, which torch.cat skips (but for the result's dtype)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


def _flat_nodes(args) -> set:
    found = set()
    torch.fx.node.map_arg(args, found.add)
    return found


def _writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether some node may write a tensor in place (node_effects.writes_first_argument: `add_`,
    `t += u`; an `out=` or `inplace=True`, an item assignment, a module set to work in place):
    then a tensor read in place could change under its reader."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            if getattr(gm.get_submodule(node.target), "inplace", False):
                return True
        elif node.op in ("call_function", "call_method") and (
                writes_first_argument(node.target) or node.target is operator.setitem
                or node.kwargs.get("out") is not None or node.kwargs.get("inplace")):
            return True
    return False
