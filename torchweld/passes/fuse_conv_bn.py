"""Fold eval-mode BatchNorm into the Conv before it: one conv with
weight * gamma / sqrt(var + eps) and a shifted bias, for inference."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

CONV_BN = ((nn.Conv1d, nn.BatchNorm1d), (nn.Conv2d, nn.BatchNorm2d), (nn.Conv3d, nn.BatchNorm3d))


def fold_conv_bn_weights(conv: nn.Module, bn: nn.Module) -> nn.Module:
    """A new conv computing bn(conv(x)) with bn's running statistics (conv and bn stay untouched)."""
    fused = copy.deepcopy(conv)
    with torch.no_grad():
        scale = bn.weight if bn.affine else torch.ones_like(bn.running_var)
        shift = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
        factor = scale / torch.sqrt(bn.running_var + bn.eps)
        shape = (-1,) + (1,) * (conv.weight.dim() - 1)
        if conv.transposed if hasattr(conv, "transposed") else False:
            raise ValueError("transposed convolutions are not folded")
        fused.weight = nn.Parameter((conv.weight * factor.reshape(shape)).to(conv.weight.dtype), requires_grad=False)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused.bias = nn.Parameter(((bias - bn.running_mean) * factor + shift).to(conv.weight.dtype), requires_grad=False)
    return fused


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    return (
        any(isinstance(conv, c) and type(bn) is b for c, b in CONV_BN)
        and not bn.training
        and bn.track_running_stats
        and bn.running_mean is not None
        and not getattr(conv, "transposed", False)
    )


def fuse_conv_bn(model: nn.Module, live: bool = False) -> torch.fx.GraphModule:
    """A GraphModule where every eval-mode `bn(conv(x))` (conv read by nothing else) is one conv.

    Takes a GraphModule or any symbolically traceable module; the input is not changed
    (the result shares its other submodules and parameters). By default the folded
    weights are computed once, here, into a new conv module. With `live=True` they are
    computed in the graph, on every call, from the conv's and the batch norm's current
    parameters and statistics (what a compiler needs: the model may be updated in place
    later; weld fuses that small computation into one kernel)."""
    gm = model if isinstance(model, torch.fx.GraphModule) else torch.fx.symbolic_trace(model)
    graph = copy.deepcopy(gm.graph)
    out = torch.fx.GraphModule(gm, graph)
    modules = dict(gm.named_modules())
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        conv_node = node.args[0]
        if conv_node.op != "call_module" or len(conv_node.users) != 1:
            continue
        conv, bn = modules.get(conv_node.target), modules.get(node.target)
        if conv is None or bn is None or not _foldable(conv, bn):
            continue
        if live:
            if getattr(conv, "padding_mode", "zeros") != "zeros" or conv_node.kwargs:
                continue
            with graph.inserting_before(node):
                fused = _folded_in_graph(graph, conv_node, conv, node.target, bn)
        else:
            name = f"{conv_node.target.replace('.', '_')}_bn_folded"
            out.add_submodule(name, fold_conv_bn_weights(conv, bn))
            with graph.inserting_after(conv_node):
                fused = graph.call_module(name, conv_node.args, conv_node.kwargs)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(conv_node)
        count += 1
    if count:
        graph.lint()
        out.recompile()
    return out


CONV_FUNCTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def _folded_in_graph(graph: torch.fx.Graph, conv_node: torch.fx.Node, conv: nn.Module, bn_name: str,
                     bn: nn.Module) -> torch.fx.Node:
    """Nodes computing bn(conv(x)) as one functional conv whose weight and bias are
    folded from the modules' current tensors on each call."""
    def attr(owner: str, name: str) -> torch.fx.Node:
        return graph.get_attr(f"{owner}.{name}")

    call = graph.call_function
    factor = call(torch.rsqrt, (call(torch.add, (attr(bn_name, "running_var"), bn.eps)),))
    if bn.affine:
        factor = call(torch.mul, (attr(bn_name, "weight"), factor))
    shape = (-1,) + (1,) * (conv.weight.dim() - 1)
    weight = call(torch.mul, (attr(conv_node.target, "weight"), call(torch.reshape, (factor, shape))))
    mean = attr(bn_name, "running_mean")
    centered = call(torch.sub, (attr(conv_node.target, "bias"), mean)) if conv.bias is not None else \
        call(torch.neg, (mean,))
    bias = call(torch.mul, (centered, factor))
    if bn.affine:
        bias = call(torch.add, (bias, attr(bn_name, "bias")))
    fn = next(f for cls, f in CONV_FUNCTIONS.items() if isinstance(conv, cls))
    args = (conv_node.args[0], weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    return call(fn, args)
