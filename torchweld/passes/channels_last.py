"""Run 2-D convolutions in channels-last layout: on CUDA tensors, and on CPU tensors
where aten's convolutions are oneDNN's (float32, bfloat16).

cuDNN's convolutions are markedly faster on NHWC tensors than on NCHW ones
(tensor-core kernels read NHWC natively), and so are oneDNN's on the CPU (a
3-to-32-channel 3x3 convolution of 8x3x64x64 took 2.97 ms NCHW against 0.25 ms
NHWC on the 2-core development machine); eager PyTorch keeps NCHW because
that is what the user's tensors are. This FX pass converts the input and the
weight of every such `Conv2d` / `F.conv2d` to channels-last (the weight
either in the graph or by the library itself, see `to_channels_last`). Everything
between two convolutions then follows that layout (PyTorch's pointwise ops
keep their input's layout, and weld stores fused results in the layout the
tracer saw), so the conversions happen once at the edges, and the weights'
once per call (a small copy; the model's parameters are read live, so
updating them needs no recompile) or, frozen, once. Graph outputs keep the layout eager gives them.

    gm = to_channels_last(gm)   # the input is not changed
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

CONV2D_FUNCTIONS = (F.conv2d, torch.conv2d)


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _converts(x: torch.Tensor | None) -> bool:
    if x is None or x.dim() != 4:
        return False
    if x.is_cuda:
        return x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return x.device.type == "cpu" and torch.backends.mkldnn.is_available() and x.dtype in (torch.float32, torch.bfloat16)


def conv_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The 2-D convolutions of `gm` that this pass converts (see `_converts`)."""
    modules = dict(gm.named_modules())
    found = []
    for node in gm.graph.nodes:
        if not node.args or not _converts(_example(node.args[0])):
            continue
        if node.op == "call_module":
            conv = modules.get(node.target)
            if type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and not node.kwargs:
                found.append(node)
        elif node.op == "call_function" and node.target in CONV2D_FUNCTIONS and isinstance(node.args[1], torch.fx.Node):
            found.append(node)
    return found


def to_channels_last(gm: torch.fx.GraphModule, weights: bool = False) -> torch.fx.GraphModule:
    """A GraphModule computing the same as `gm` with its convolutions in channels-last.

    The weights of CUDA convolutions are converted in the graph, and so are all of them
    with `weights=True` (for a compiler that then computes that once); otherwise oneDNN
    converts them itself, from C++. cuDNN's own conversion is a strided aten copy per
    weight: resnet50's 17 took 82 us of a 3 ms call on the H100, weld's kernels for the
    same 69-81 us (a scratch profile, bench/DECISIONS.md#cuda-weights-channels-last)."""
    convs = conv_nodes(gm)
    if not convs:
        return gm
    graph = copy.deepcopy(gm.graph)  # (its nodes' metadata shared: a shallow copy each)
    modules = dict(gm.named_modules())
    by_name = {n.name: n for n in graph.nodes}
    for original in convs:
        node = by_name[original.name]
        convert_weight = weights or _example(original.args[0]).is_cuda
        with graph.inserting_before(node):
            if node.op == "call_module":
                conv = modules[node.target]
                weight = graph.get_attr(f"{node.target}.weight")
                bias = graph.get_attr(f"{node.target}.bias") if conv.bias is not None else None
                x = _channels_last(graph, node.args[0])
                weight = _channels_last(graph, weight) if convert_weight else weight
                args = (x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
                new = graph.call_function(F.conv2d, args)
            else:
                args = list(node.args)
                args[0] = _channels_last(graph, args[0])
                args[1] = _channels_last(graph, args[1]) if convert_weight else args[1]
                new = graph.call_function(node.target, tuple(args), node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    _outputs_as_eager(graph)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)  # (made once the graph is final: its code generated once)


def _channels_last(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    return graph.call_method("contiguous", (value,), {"memory_format": torch.channels_last})


def _outputs_as_eager(graph: torch.fx.Graph) -> None:
    """Graph outputs in the layout eager gives them (contiguous or channels-last)."""
    output = next(n for n in graph.nodes if n.op == "output")

    def restore(arg):
        x = _example(arg)
        if x is None or x.dim() != 4:
            return arg
        for fmt in (torch.contiguous_format, torch.channels_last):
            if x.is_contiguous(memory_format=fmt):
                with graph.inserting_before(output):
                    node = graph.call_method("contiguous", (arg,), {"memory_format": fmt})
                node.meta = dict(arg.meta)
                return node
        return arg

    output.args = (torch.fx.node.map_arg(output.args[0], restore),)
