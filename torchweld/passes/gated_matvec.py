"""A SwiGLU feed-forward's gate and up projections of one row as one kernel.

Llama's feed-forward (gpt-fast's `w2(silu(w1(x)) * w3(x))`, transformers' LlamaMLP
`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) multiplies the same row by two weights, then
combines the two products in a pointwise kernel. Decoding one token at a time, each product
is a matrix-vector product bound by reading its weights, and the three kernels are three
launches a layer. Here

    silu(linear(x, w_gate)) * linear(x, w_up)

with x of one row (its leading sizes 1), no biases, becomes one `torchweld::gated_matvec(x row,
w_gate, w_up)` (runtime/decode_matvec.py): a kernel that walks both weights' columns together
and stores the gated product. Only on CUDA in half precision, in inference graphs that CUDA
graphs replay (launched from Python, Triton's launcher would cost the host more than it saves),
and where the two products and silu's result are read by nothing else.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

MULS = (operator.mul, torch.mul, "mul")
SILUS = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)
LINEARS = (F.linear, torch._C._nn.linear)


def fuse_gated_products(gm: GraphModule) -> GraphModule:
    """`gm` with each one-row SwiGLU gate (see the module's docstring) one gated_matvec call
    (in place; returned for chaining)."""
    matches = [(node, match) for node in list(gm.graph.nodes) if (match := _match(gm, node)) is not None]
    if not matches:
        return gm
    from torchweld.runtime import decode_matvec  # defines the op (reads its source): only where used

    graph = gm.graph
    for node, (x, (gate_weight, up_weight), dead) in matches:
        shape = tuple(_example(node).shape)
        with graph.inserting_before(node):
            row = graph.call_method("reshape", (x, (1, _example(x).shape[-1])))
            row.meta["example_value"] = _example(x).reshape(1, -1)
            weights = [_weight_node(gm, w) for w in (gate_weight, up_weight)]
            gated = graph.call_function(decode_matvec.gated_matvec, (row, *weights))
            gated.meta["example_value"] = row.meta["example_value"].new_empty((1, shape[-1]))
            result = graph.call_method("reshape", (gated, shape))
        result.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
        result.meta["example_value"] = _example(node).new_empty(shape)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        for n in dead:  # silu, then the two products: read by nothing now
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm


def _match(gm: GraphModule, node: Node):
    """(x, (gate weight, up weight), the nodes the rewrite leaves unread) of a one-row
    `silu(linear(x, w_gate)) * linear(x, w_up)` at `node`, or None."""
    if node.op not in ("call_function", "call_method") or node.target not in MULS or len(node.args) != 2 \
            or node.kwargs or not all(isinstance(a, Node) for a in node.args):
        return None
    for act, up in (node.args, node.args[::-1]):
        gate = _silu_input(gm, act)
        if gate is None:
            continue
        gate_linear, up_linear = _linear(gm, gate), _linear(gm, up)
        if gate_linear is None or up_linear is None or gate_linear[0] is not up_linear[0]:
            continue
        if not all(len(n.users) == 1 for n in (act, gate, up)) or gate is up:
            continue
        x = gate_linear[0]
        if not _fits(gm, x, gate_linear[1], up_linear[1], _example(node)):
            continue
        return x, (gate_linear[1], up_linear[1]), (act, gate, up)
    return None


def _silu_input(gm: GraphModule, node: Node) -> Node | None:
    """The node `node` is silu of (F.silu, or an nn.SiLU module; not in place), or None."""
    if node.op == "call_function" and node.target in SILUS:
        inplace = node.kwargs.get("inplace", node.args[1] if len(node.args) > 1 else False)
        arg = node.args[0] if node.args else None
        return arg if isinstance(arg, Node) and inplace is False else None
    if node.op == "call_method" and node.target == "silu" and len(node.args) == 1:
        return node.args[0] if isinstance(node.args[0], Node) else None
    if node.op == "call_module" and type(gm.get_submodule(node.target)) is torch.nn.SiLU \
            and not gm.get_submodule(node.target).inplace and len(node.args) == 1 and not node.kwargs:
        return node.args[0] if isinstance(node.args[0], Node) else None
    return None


def _linear(gm: GraphModule, node: Node):
    """(input, weight) of a `node` that is a linear layer without a bias: an nn.Linear module
    (weight: its attribute path) or F.linear (weight: a node), or None."""
    if node.op == "call_module" and type(gm.get_submodule(node.target)) is torch.nn.Linear:
        module = gm.get_submodule(node.target)
        if module.bias is None and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], Node):
            return node.args[0], f"{node.target}.weight"
        return None
    if node.op == "call_function" and node.target in LINEARS:
        bias = node.kwargs.get("bias", node.args[2] if len(node.args) > 2 else None)
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        x = node.args[0] if node.args else node.kwargs.get("input")
        if bias is None and isinstance(x, Node) and isinstance(weight, Node):
            return x, weight
    return None


def _weight_node(gm: GraphModule, weight) -> Node:
    """A node for `weight`: itself, or a get_attr of its attribute path."""
    if isinstance(weight, Node):
        return weight
    node = gm.graph.get_attr(weight)
    node.meta["example_value"] = gm.get_parameter(weight)
    return node


def _weight_example(gm: GraphModule, weight) -> torch.Tensor | None:
    """The weight itself (a module's parameter, a get_attr's target) or its example value."""
    if isinstance(weight, str):
        return gm.get_parameter(weight)
    if weight.op == "get_attr":
        value = gm
        for part in weight.target.split("."):
            value = getattr(value, part, None)
        return value if isinstance(value, torch.Tensor) else None
    return _example(weight)


def _fits(gm: GraphModule, x: Node, gate_weight, up_weight, out: torch.Tensor | None) -> bool:
    """One row of half precision on CUDA, two weights of one shape and dtype, every size a number."""
    xe, ge, ue = _example(x), _weight_example(gm, gate_weight), _weight_example(gm, up_weight)
    if xe is None or ge is None or ue is None or out is None or xe.dim() < 1 or ge.dim() != 2:
        return False
    sizes = [*xe.shape, *ge.shape, *ue.shape, *out.shape]
    if not all(isinstance(s, int) for s in sizes):
        return False  # symbolic sizes would go into the new nodes' arguments as numbers
    return (all(map(on_kernel_device, (xe, ge, ue))) and xe.dtype in (torch.float16, torch.bfloat16)
            and ge.dtype == ue.dtype == xe.dtype and math.prod(xe.shape[:-1]) == 1
            and tuple(ge.shape) == tuple(ue.shape) and ge.shape[1] == xe.shape[-1])


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether `t` is where the kernel runs (CUDA; tests let the CPU pass, where the op runs
    eager's three kernels instead)."""
    return t.is_cuda


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None
