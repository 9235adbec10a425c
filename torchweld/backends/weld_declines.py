"""Which graphs the weld backend runs as they are (gm.forward) instead of compiling them,
and why: tensors on a device weld generates no code for, symbolic sizes, sparse tensors
and complex numbers.

weld's kernels are C++ for CPU tensors and Triton for CUDA ones; a meta tensor's (or
any other device's) data pointer handed to a C++ kernel crashed the process. Its
lowering computes with the example inputs' sizes: a graph whose sizes are symbolic
(torch.compile marks a dim dynamic when a second call changes it) would be compiled
for the first size and give wrong answers for every other one. Its kernels index strided
memory and compute in real numbers: a sparse tensor (CSR, COO, ...) has no strides, and a
complex one (`a * a + 1j`) no loop IR type; eager's kernels run such graphs.
"""
from __future__ import annotations

import enum

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
)

# What weld's trace with fake tensors raises where the graph reads tensor data as a Python
# number (a training-mode BatchNorm with momentum=None divides by its batch counter) or runs
# an op without a fake kernel: capture ran those module calls on the real parameters and
# buffers, weld's trace runs them on fakes. Such a graph runs as captured.
UNTRACEABLE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)

DEVICES_WITH_CODEGEN = frozenset({"cpu", "cuda"})
SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class Decline(enum.Enum):
    """Why weld runs a graph without its kernels; the value is the hint its log line gives."""

    DEVICE = "weld generates kernels for CPU and CUDA tensors only"
    # not a decline: such a graph is compiled over its symbols (weld_symbolic.py), else per size (weld_sizes.py)
    SYMBOLIC_SIZES = "symbolic sizes: weld compiles the graph over its symbols, or else once per size"
    SPARSE = "weld's kernels read strided tensors only; a graph with a sparse tensor runs as captured"
    COMPLEX = "weld's kernels compute in real numbers; a graph with complex values runs as captured"


def why_declined(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[Decline, str] | None:
    """(the kind, the detail) of why weld must not compile `gm`, or None if it may."""
    tensors = _real_tensors(gm, example_inputs)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in DEVICES_WITH_CODEGEN:
            return Decline.DEVICE, f"a tensor on {t.device}"
    examples = _example_values(gm)
    for value in tensors + examples:
        if is_symbolic(value):
            return Decline.SYMBOLIC_SIZES, f"{value!r} is symbolic"
    for t in tensors + examples:
        if isinstance(t, torch.Tensor) and t.layout is not torch.strided:
            return Decline.SPARSE, f"a tensor of layout {t.layout}"
    for t in tensors + examples:
        if isinstance(t, torch.Tensor) and t.is_complex():
            return Decline.COMPLEX, f"a tensor of dtype {t.dtype}"
    for node in gm.graph.nodes:
        if any(isinstance(a, complex) for a in pytree.tree_leaves((node.args, node.kwargs))):
            return Decline.COMPLEX, f"the complex constant in {node.format_node()}"
    return None


def is_symbolic(value: object) -> bool:
    """Whether `value` is a symbolic number, or a tensor with a symbolic size, stride or offset."""
    if isinstance(value, SYMBOLIC_TYPES):
        return True
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return False
    return (any(isinstance(s, SYMBOLIC_TYPES) for s in (*value.shape, *value.stride()))
            or isinstance(value.storage_offset(), SYMBOLIC_TYPES))


def _real_tensors(gm: torch.fx.GraphModule, example_inputs: list) -> list:
    """The example inputs and the module's tensors: what weld's kernels would be handed."""
    values = list(pytree.tree_leaves(list(example_inputs)))
    values += list(gm.parameters()) + list(gm.buffers())
    return values + [v for v in gm.__dict__.values() if isinstance(v, torch.Tensor)]


def _example_values(gm: torch.fx.GraphModule) -> list:
    """Every node's example value (capture's `example_value`, a trace's `val`): fake or meta
    tensors, whose device says nothing of the real one's, but whose sizes may be symbolic."""
    values = []
    for node in gm.graph.nodes:
        for key in ("example_value", "val"):
            if key in node.meta:
                values += pytree.tree_leaves(node.meta[key])
    return values
