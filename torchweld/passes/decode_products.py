"""A decoding step's matrix-vector products that read one row, fewer launches: a SwiGLU gate
as one kernel, and the products of one row by several weights as one kernel.

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

transformers' Llama projects the same row to queries, keys and values by three weights (gpt-fast
keeps them as one). `group_shared_input_products` makes two to four such bias-free linear
layers of one row one `torchweld::grouped_matvec(x row, [weights])`, a kernel whose programs
take the columns of one weight each, the products returned as they were. Same conditions.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from torchweld.runtime import decode_matvec
from torchweld.runtime.decode_matvec import MAX_GROUP

MULS = (operator.mul, torch.mul, "mul")
SILUS = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)
LINEARS = (F.linear, torch._C._nn.linear)


def fuse_gated_products(gm: GraphModule) -> GraphModule:
    """`gm` with each one-row SwiGLU gate (see the module's docstring) one gated_matvec call
    (in place; returned for chaining)."""
    matches = [(node, match) for node in list(gm.graph.nodes) if (match := _match(gm, node)) is not None]
    if not matches:
        return gm
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


def group_shared_input_products(gm: GraphModule) -> GraphModule:
    """`gm` with the one-row bias-free linear layers that read the same row (see the module's
    docstring) grouped, up to MAX_GROUP a call, each group one grouped_matvec call (in place;
    returned for chaining)."""
    groups = []
    for x in gm.graph.nodes:
        linears = [(user, _linear(gm, user)[1]) for user in x.users if _reads_row(gm, user, x)]
        linears = [(user, weight) for user, weight in linears if _fits(gm, x, [weight], _example(user))]
        groups += [(x, linears[i:i + MAX_GROUP]) for i in range(0, len(linears), MAX_GROUP) if len(linears) - i >= 2]
    if not groups:
        return gm
    graph = gm.graph
    position = _position(graph)
    for x, group in groups:
        first = min((user for user, _ in group), key=position)
        for _, weight in group:  # an attribute read after the first layer: read before it
            if isinstance(weight, Node) and weight.op == "get_attr" and position(weight) > position(first):
                first.prepend(weight)
        with graph.inserting_before(first):
            row = graph.call_method("reshape", (x, (1, _example(x).shape[-1])))
            row.meta["example_value"] = _example(x).reshape(1, -1)
            weights = [_weight_node(gm, weight) for _, weight in group]
            call = graph.call_function(decode_matvec.grouped_matvec, (row, weights))
            call.meta["example_value"] = [_example(user).new_empty((1, _example(user).shape[-1])) for user, _ in group]
            for i, (user, _) in enumerate(group):
                product = graph.call_function(operator.getitem, (call, i))
                product.meta["example_value"] = call.meta["example_value"][i]
                result = graph.call_method("reshape", (product, tuple(_example(user).shape)))
                result.meta.update({k: v for k, v in user.meta.items() if k != "example_value"})
                result.meta["example_value"] = _example(user).new_empty(_example(user).shape)
                user.replace_all_uses_with(result)
        for user, _ in group:
            graph.erase_node(user)
    graph.lint()
    gm.recompile()
    return gm


def _reads_row(gm: GraphModule, node: Node, x: Node) -> bool:
    """Whether `node` is a bias-free linear layer of input `x` whose weight is a module's
    parameter or an input or attribute of the graph (which the group can read before `node`)."""
    linear = _linear(gm, node)
    return (linear is not None and linear[0] is x
            and (isinstance(linear[1], str) or linear[1].op in ("placeholder", "get_attr")))


def _position(graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


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
        if not _fits(gm, x, [gate_linear[1], up_linear[1]], _example(node)) \
                or _weight_example(gm, gate_linear[1]).shape != _weight_example(gm, up_linear[1]).shape:
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


def _fits(gm: GraphModule, x: Node, weights: list, out: torch.Tensor | None) -> bool:
    """x one row of half precision on CUDA, `weights` 2-d of its dtype and width, every size a number."""
    xe, examples = _example(x), [_weight_example(gm, w) for w in weights]
    if xe is None or out is None or xe.dim() < 1 or any(e is None or e.dim() != 2 for e in examples):
        return False
    sizes = [*xe.shape, *out.shape, *(s for e in examples for s in e.shape)]
    if not all(isinstance(s, int) for s in sizes):
        return False  # symbolic sizes would go into the new nodes' arguments as numbers
    return (all(map(on_kernel_device, (xe, *examples))) and xe.dtype in (torch.float16, torch.bfloat16)
            and math.prod(xe.shape[:-1]) == 1 and all(e.dtype == xe.dtype and e.shape[1] == xe.shape[-1]
                                                         for e in examples))


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether `t` is where the kernel runs (CUDA; tests let the CPU pass, where the op runs
    eager's three kernels instead)."""
    return t.is_cuda


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None
