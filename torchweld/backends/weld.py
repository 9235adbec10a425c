"""The `weld` backend: fused C++/OpenMP kernels for CPU tensors and Triton kernels
for CUDA tensors, with aten kernels (matmul, convolution, ...) called where no
lowering exists. Inference only for now: a graph that needs autograd runs eagerly."""
from __future__ import annotations

import functools
import logging

import torch

from torchweld.backends import register_backend

log = logging.getLogger("torchweld.weld")


@functools.cache
def _log_training_fallback_once() -> None:
    log.info("weld compiles inference only for now: a graph that needs autograd runs eagerly "
             "(run under torch.no_grad() or with requires_grad=False tensors to compile it)")


def needs_autograd(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    tensors += [v for v in gm.__dict__.values() if isinstance(v, torch.Tensor)]
    return any(t.requires_grad for t in tensors)


@register_backend("weld")
def weld(gm: torch.fx.GraphModule, example_inputs: list, mode=None, options=None):
    if needs_autograd(gm, example_inputs):
        _log_training_fallback_once()
        return gm.forward
    from torchweld.compiler import compile_graph
    from torchweld.compiler.lowering import LoweringError
    from torchweld.runtime.cpp_loader import CppCompileError

    graph_module = gm
    if not torch.is_grad_enabled():
        from torchweld.passes.fuse_conv_bn import fuse_conv_bn

        graph_module = fuse_conv_bn(gm)
    try:
        return compile_graph(graph_module, list(example_inputs), options)
    except (LoweringError, CppCompileError) as e:
        log.warning("weld cannot compile this graph, running it eagerly: %s", e)
        return gm.forward
