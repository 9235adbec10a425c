"""Run a partitioned training graph: one `torch.autograd.Function` whose forward
runs the compiled forward graph, writes new buffer values back and saves what the
partition chose, and whose backward runs the compiled backward graph."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.utils._pytree as pytree

from torchweld.errors import TorchweldError
from torchweld.runtime.unflatten import unflattener

log = logging.getLogger("torchweld.weld")


class DoubleBackwardError(TorchweldError, RuntimeError):
    """create_graph=True through a compiled graph: its backward is not itself differentiable."""


@dataclasses.dataclass
class TrainingGraph:
    """What CompiledGraphFunction needs; `compile_backward` runs on the first backward, with real tensors."""

    forward: Callable  # (*primals) -> (*outputs, *new_values, *saved intermediates)
    compile_backward: Callable[[list], Callable]  # example (saved + numbers + tangents) -> that list -> grads
    num_outputs: int
    out_spec: pytree.TreeSpec
    diff_outputs: list[int]
    mutated_primals: list[int]
    grad_primals: list[int]
    saved: list[tuple[str, int]]
    write_back: Callable[[list, list], None]  # (mutated primals, new values): runtime/write_back.py
    backward: Callable | None = None  # [*saved, *numbers, *tangents] -> grads, emptying the list (_boxed)
    # The forward is a CUDA-graph replay that lends what follows the outputs (runtime/cudagraphs.py,
    # lent_from): it returns (results, lease), and the lease is saved with the activations, so
    # that the recording counts as busy until the backward has let go of them
    forward_lends: bool = False
    input_view_outputs: frozenset = frozenset()  # outputs that view a primal (JointGraph's)
    written_primal_views: dict = dataclasses.field(default_factory=dict)  # JointGraph's
    primal_outputs: dict = dataclasses.field(default_factory=dict)  # JointGraph's
    primal_views: dict = dataclasses.field(default_factory=dict)  # JointGraph's
    # compiled under no_grad, and for training only by a `with torch.enable_grad()` block in it:
    # its outputs made there require grad, so the Function is applied with grad mode on
    enables_grad: bool = False
    # over symbolic sizes, the ints the backward reads after the saved tensors (Partition's):
    # (i, d), the size d of primal i, or (i, None), primal i itself
    numbers: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # worked out once, not per call: which saved values are primals that the write-back
        # overwrites (the backward reads their value before it), which outputs are differentiable
        mutated = set(self.mutated_primals)
        self.saved_clones = [kind == "primal" and i in mutated for kind, i in self.saved]
        diff = set(self.diff_outputs)
        self.non_diff_outputs = [i for i in range(self.num_outputs) if i not in diff]
        self.outputs = unflattener(self.out_spec)  # the flat outputs -> what the graph returns


def _fresh_view(t):
    """A saved view made anew now, from its base: a view object kept from a CUDA graph recording
    (a static output viewing a parameter) has the version its base had then, and autograd refuses
    to unpack a view made in no_grad whose base has been written since. (Only for a forward whose
    outputs a recording lends: other forwards make their views at each call.)"""
    if not isinstance(t, torch.Tensor) or not t._is_view() or t._base is None:
        return t
    return t._base.as_strided(t.size(), t.stride(), t.storage_offset())


class CompiledGraphFunction(torch.autograd.Function):
    """The autograd node of a torchweld-compiled graph (`grad_fn=<CompiledGraphFunctionBackward>`)."""

    @staticmethod
    def forward(ctx, graph: TrainingGraph, *primals):
        results = graph.forward(*primals)
        lease = None
        if graph.forward_lends:
            results, lease = results
        results = list(results)
        k, m = graph.num_outputs, len(graph.mutated_primals)
        outputs, new_values, intermediates = results[:k], results[k:k + m], results[k + m:]
        saved = [primals[i] if kind == "primal" else intermediates[i] for kind, i in graph.saved]
        if lease is not None:  # the recording's own outputs: its views made anew (_fresh_view)
            saved = [_fresh_view(t) for t in saved]
        if new_values:
            # a primal the backward reads at its value before the write-back: keep that value
            saved = [s.clone() if clone else s for s, clone in zip(saved, graph.saved_clones)]
            # a multi-tensor kernel per dtype, not a copy per buffer (batch norm's statistics)
            graph.write_back([primals[i] for i in graph.mutated_primals], new_values)
            for i, (j, size, stride, offset) in graph.written_primal_views.items():
                outputs[i] = primals[j].as_strided(size, stride, primals[j].storage_offset() + offset)
        ctx.graph = graph
        ctx.leased = lease is not None
        ctx.numbers = [primals[i] if d is None else primals[i].size(d) for i, d in graph.numbers] \
            if graph.numbers else ()  # (over static sizes, nothing to read at each call)
        ctx.save_for_backward(*saved, *([lease] if ctx.leased else []))
        _unview_intermediates(outputs, graph.input_view_outputs | graph.written_primal_views.keys())
        for i in graph.non_diff_outputs:
            if isinstance(outputs[i], torch.Tensor) and outputs[i].requires_grad:
                # a view of an input that requires grad (`t.view(-1).detach()`, made a view of
                # `t`) would keep requiring grad, marked non-differentiable or not
                outputs[i] = outputs[i].detach()
        ctx.mark_non_differentiable(*[outputs[i] for i in graph.non_diff_outputs
                                      if isinstance(outputs[i], torch.Tensor)])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():
            raise DoubleBackwardError(
                "torchweld compiled this graph for first-order gradients only; backward(create_graph=True) "
                "(double backward) through it is not supported. Compile it with backend='eager', or run "
                "this part without torchweld.compile.")
        graph: TrainingGraph = ctx.graph
        tangents = [_dense(grad_outputs[i]) for i in graph.diff_outputs]
        saved = ctx.saved_tensors
        args = [*(saved[:-1] if ctx.leased else saved), *ctx.numbers, *tangents]
        del saved
        if graph.backward is None:
            graph.backward = _boxed(graph.compile_backward(args))
        # ctx lets go of the saved tensors (unless retain_graph) and the compiled backward
        # empties `args`: each saved activation is freed after its last reader, as eager's
        # autograd frees it after its node (resnet50's step peaked ~750 MiB higher otherwise)
        ctx.maybe_clear_saved_tensors()
        grads = list(graph.backward(args))
        result = [None] * (len(ctx.needs_input_grad) - 1)
        for i, g in zip(graph.grad_primals, grads):
            result[i] = g
        return (None, *result)


def _unview_intermediates(outputs: list, input_views: frozenset) -> None:
    """An output that views a tensor made inside the graph (`h.transpose(1, 2)` of a matmul's
    result, or the wrapper's `buf.as_strided(...)`) goes out as a tensor of its own to autograd
    (`detach()`: the same memory, no copy). Autograd forbids in-place changes to the views a
    custom Function returns, so the user's `hidden[mask] = v` after a graph break failed where
    eager's worked. Outputs that view an input (decided by the trace, not per call) keep their
    view, as eager's do."""
    for i, out in enumerate(outputs):
        if i not in input_views and isinstance(out, torch.Tensor) and out._is_view():
            outputs[i] = out.detach()


def _boxed(backward: Callable) -> Callable[[list], object]:
    """The compiled backward as a callable of one list of inputs, which it empties: weld's
    compiled graph frees each input after its last reader (CompiledGraph.call_boxed); a
    CUDA-graph replay or an aten graph run eagerly takes them positionally."""
    call_boxed = getattr(backward, "call_boxed", None)
    if call_boxed is not None:
        return call_boxed

    def call(args: list):
        inputs = tuple(args)
        args.clear()
        return backward(*inputs)

    return call


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Tangents arrive in any layout (an expanded scalar from .sum(), ...); kernels want them dense."""
    return t if t.is_contiguous() else t.contiguous()


def run(graph: TrainingGraph, primals: list[torch.Tensor]):
    with torch.set_grad_enabled(torch.is_grad_enabled() or graph.enables_grad):
        outputs = list(CompiledGraphFunction.apply(graph, *primals))
    for i, j in graph.primal_outputs.items():  # the primal itself, as eager returns it
        outputs[i] = primals[j]
    for i, (j, size, stride, offset) in graph.primal_views.items():
        # a view of a primal, as autograd's view of it (AOTAutograd's regenerated aliases): a custom
        # Function's output viewing its input may not be changed in place, eager's view may
        grad = (torch.is_grad_enabled() or graph.enables_grad) and i not in graph.non_diff_outputs
        with torch.set_grad_enabled(grad):
            outputs[i] = primals[j].as_strided(size, stride, primals[j].storage_offset() + offset)
    return graph.outputs(outputs)
