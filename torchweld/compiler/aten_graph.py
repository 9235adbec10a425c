"""Trace a torch-level FX graph down to an aten-level one, with fake tensors and
the decompositions that reach the small op set `lowering.py` handles."""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from torchweld.compiler import decompositions
from torchweld.compiler.aten_trace import AtenRecorder
from torchweld.compiler.graph_modules import graph_module
from torchweld.compiler.pipeline import run_aten_passes
from torchweld.fake_tensors import fake_copy

aten = torch.ops.aten

# Composite ops we take apart; what remains is pointwise math, reductions,
# views and a few kernels (mm, convolution, pooling) that stay extern calls.
DECOMPOSED_OPS = [
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional,
    aten.native_batch_norm,
    aten.cudnn_batch_norm,  # what batch_norm becomes for CUDA tensors: pointwise, not an extern call
    aten._batch_norm_no_update,
    aten._batch_norm_with_update,
    aten.native_layer_norm,
    aten.native_group_norm,
    aten._softmax,
    aten._log_softmax,
    aten._safe_softmax,  # what scaled_dot_product_attention's math path calls under a mask (CUDA)
    aten.gelu,
    aten.silu,
    aten.mish,
    aten.hardswish,
    aten.hardsigmoid,
    aten.hardtanh,
    aten.leaky_relu,
    aten.elu,
    aten.softplus,
    aten.native_dropout,
    aten.dropout,
    aten.addmm,
    aten.linear,
    aten.t,
    aten.mean,
    aten.var,
    aten.var_mean,
    aten.std,
    aten.clamp_min,
    aten.clamp_max,
    aten.masked_fill,
    aten.rsub,
    aten.addcdiv,
    aten.logsumexp,
    aten.norm,
    aten.linalg_vector_norm,
    aten.full_like,
    aten.ones_like,
    aten.zeros_like,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.expand_as,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.square,
    aten.xlogy,
    aten.baddbmm,
    aten.silu_,
    aten.relu6,
    aten.mse_loss,
]

DECOMPOSITIONS = {**get_decompositions(DECOMPOSED_OPS), **decompositions.OWN}


# In-place overloads whose functional variant is not simply "drop the trailing underscore".
FUNCTIONAL_VARIANTS = {
    aten.copy_.default: aten.copy.default,
    aten.bernoulli_.float: aten.bernoulli.p,
    aten.bernoulli_.Tensor: aten.bernoulli.Tensor,
}


def pure_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional variant of an in-place aten overload (`aten.relu_` -> `aten.relu`), or None."""
    if target in FUNCTIONAL_VARIANTS:
        return FUNCTIONAL_VARIANTS[target]
    name = target.overloadpacket.__name__
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return None if overload is None or overload._schema.is_mutable else overload


@dataclasses.dataclass(frozen=True)
class AtenGraph:
    """An aten-level graph taking the inputs flat and returning its outputs flat."""

    gm: torch.fx.GraphModule
    out_spec: pytree.TreeSpec


def traced_aten_graph(gm: torch.fx.GraphModule) -> AtenGraph:
    """An aten graph traced already (the training partitions: decomposed, with "val"
    metadata on every node) as an AtenGraph, without tracing it again: its outputs
    flattened (None entries dropped; out_spec puts them back)."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    flat, spec = pytree.tree_flatten(output.args[0])
    output.args = (flat,)
    graph.eliminate_dead_code()
    return AtenGraph(graph_module(gm, graph), spec)


def to_aten_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> AtenGraph:
    """Trace `gm` with fake copies of `example_inputs`; parameters and buffers become
    get_attr constants (the module runs on fakes of them, made once each)."""
    # symbolic inputs (backends/weld_symbolic.py) are fakes already, of a mode whose ShapeEnv
    # records what the trace assumes about their sizes
    given = next((x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)), None)
    recorder = AtenRecorder(DECOMPOSITIONS)
    with torch.no_grad(), given or FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = [recorder.placeholder(x if isinstance(x, FakeTensor) else
                                            fake_copy(mode, x) if isinstance(x, torch.Tensor) else x)
                       for x in example_inputs]
        fakes: dict[int, torch.Tensor] = {}  # id(real) -> its fake, so tied weights stay one tensor
        state = {}
        for name, real in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            fake = fakes.get(id(real))
            if fake is None:
                fake = fakes[id(real)] = fake_copy(mode, real)
                recorder.constant(fake, real)
            state[name] = fake
        with recorder, _reparametrize_module(gm, state):
            flat, spec = pytree.tree_flatten(gm(*fake_inputs))
    aten_gm = recorder.graph_module(flat)
    run_aten_passes(aten_gm.graph)
    return AtenGraph(aten_gm, spec)
