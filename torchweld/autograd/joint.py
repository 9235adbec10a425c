"""Trace one captured graph's forward and backward together, at the aten level:
the module state it reads (parameters, buffers, tensor attributes) is lifted to
inputs, `torch.autograd.grad` of its outputs is traced with tangents as extra
inputs, and the result is functionalized (buffer updates become outputs)."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from torchweld.autograd.functionalize import FunctionalizationError, functionalize
from torchweld.autograd.smaller_saves import smaller_saves
from torchweld.compiler import decompositions
from torchweld.compiler.aten_graph import DECOMPOSITIONS
from torchweld.compiler.aten_trace import AtenRecorder
from torchweld.compiler.pipeline import run_aten_passes
from torchweld.fake_tensors import fake_copy
from torchweld.node_effects import is_pure_node, module_draws_random, target_name

aten = torch.ops.aten

# Backward ops taken apart into pointwise math and reductions, so they fuse.
BACKWARD_DECOMPOSITIONS = get_decompositions([
    aten.threshold_backward,
    aten.native_layer_norm_backward,
    aten.native_batch_norm_backward,
    aten.cudnn_batch_norm_backward,  # what batch norm's backward is for CUDA tensors
    aten.miopen_batch_norm_backward,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.gelu_backward,
    aten.silu_backward,
    aten.hardtanh_backward,
    aten.leaky_relu_backward,
    aten.elu_backward,
    aten.native_dropout_backward,
    aten.nll_loss_backward,
    aten.mse_loss_backward,
])
JOINT_DECOMPOSITIONS = {**DECOMPOSITIONS, **BACKWARD_DECOMPOSITIONS, **decompositions.OWN_BACKWARD}


@dataclasses.dataclass
class ModuleState:
    """A tensor the graph reads from its module, by qualified name (read afresh at every call)."""

    name: str
    kind: str  # "parameter", "buffer" or "attribute"

    def owner(self, gm: torch.nn.Module) -> tuple[torch.nn.Module, str]:
        """(the module that holds this tensor, its attribute name there)."""
        owner, _, attr = self.name.rpartition(".")
        return gm.get_submodule(owner) if owner else gm, attr

    def read(self, gm: torch.nn.Module) -> torch.Tensor:
        return getattr(*self.owner(gm))

    def write(self, gm: torch.nn.Module, value: torch.Tensor) -> None:
        setattr(*self.owner(gm), value)


class StateReader:
    """`read()`: the tensors of `state`, read afresh (a replaced parameter is seen).

    Each is looked up in the dict that holds it on its owning module (`_parameters`,
    `_buffers` or `__dict__`), found once, here: one dict lookup per tensor at each call
    instead of nn.Module.__getattr__ (densenet121 reads ~730 a step). A tensor that has
    left its dict since (deleted, set as another kind of attribute) is read by getattr, as is
    one whose module class defines `__getattr__` or an attribute of that name itself."""

    def __init__(self, gm: torch.nn.Module, state: list[ModuleState]):
        self.gm, self.state = gm, state
        self.places = []
        for s in state:
            owner, attr = s.owner(gm)
            held = next((d for d in (owner._parameters, owner._buffers, owner.__dict__) if attr in d), None)
            plain = type(owner).__getattr__ is torch.nn.Module.__getattr__ and not hasattr(type(owner), attr)
            self.places.append((held if held is not None and plain else _Getattr(owner), attr))

    def read(self) -> list[torch.Tensor]:
        try:
            return [held[attr] for held, attr in self.places]
        except KeyError:
            return [s.read(self.gm) for s in self.state]


class _Getattr:
    """A module's attributes through getattr, indexed as a dict is (StateReader's slow path)."""

    def __init__(self, owner: torch.nn.Module):
        self.owner = owner

    def __getitem__(self, attr: str):
        return getattr(self.owner, attr)


def module_state(gm: torch.fx.GraphModule) -> list[ModuleState]:
    """Parameters, buffers and plain tensor attributes that `gm` reads, each once."""
    state = [ModuleState(n, "parameter") for n, _ in gm.named_parameters()]
    state += [ModuleState(n, "buffer") for n, _ in gm.named_buffers()]
    known = {s.name for s in state}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in known:
            value = ModuleState(node.target, "attribute").read(gm)
            if isinstance(value, torch.Tensor):
                state.append(ModuleState(node.target, "attribute"))
                known.add(node.target)
    return state


@contextlib.contextmanager
def substituted(gm: torch.nn.Module, state: list[ModuleState], values: list[torch.Tensor]):
    """Run `gm` with `values` in place of its state tensors."""
    tensors = {s.name: v for s, v in zip(state, values) if s.kind != "attribute"}
    attributes = [(s, v) for s, v in zip(state, values) if s.kind == "attribute"]
    saved = [(s, s.read(gm)) for s, _ in attributes]
    try:
        for s, v in attributes:
            s.write(gm, v)
        with _reparametrize_module(gm, tensors, tie_weights=True):
            yield
    finally:
        for s, v in saved:
            s.write(gm, v)


@dataclasses.dataclass
class JointGraph:
    """A functional aten graph `(*primals, *tangents) -> (*outputs, *new_values, *grads)`.

    primals: the module state, then the tensor inputs. outputs: the user's outputs,
    flat (`out_spec` rebuilds them). new_values: one per entry of `mutated_primals`.
    grads: one per entry of `grad_primals` (None where the primal gets no gradient).
    tangents: one per entry of `diff_outputs` (the outputs that require grad)."""

    gm: torch.fx.GraphModule
    num_primals: int
    num_outputs: int
    out_spec: pytree.TreeSpec
    diff_outputs: list[int]
    mutated_primals: list[int]
    grad_primals: list[int]
    # primals that stay in memory whatever the partition saves: the module's state (the first
    # primals) and parameters the graph takes as inputs
    resident_primals: frozenset = frozenset()
    # outputs that are views of a primal (`x.view(-1)`), as the trace found them
    input_view_outputs: frozenset = frozenset()
    # output -> (primal, its sizes, strides and storage offset in the primal's memory) for the
    # outputs that view (or are) a primal the graph writes in place: the functional graph
    # computes them from the new value, and they go out as views of the primal once written
    written_primal_views: dict = dataclasses.field(default_factory=dict)
    # output -> primal for the outputs that are a primal itself (`x.to(x.dtype)`): eager
    # returns that very tensor, which a custom autograd Function cannot (it returns a view)
    primal_outputs: dict = dataclasses.field(default_factory=dict)
    # output -> (primal, sizes, strides, storage offset in the primal's memory) for the outputs that
    # view a primal the graph does not write: taken again of the primal outside the custom
    # Function, so that they are autograd's views of it (a custom Function's may not be changed in place)
    primal_views: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tangents(self) -> int:
        return len(self.diff_outputs)

    def node_groups(self) -> tuple[list, list, list, list, list]:
        """(primal placeholders, tangent placeholders, output values, new values, grad values)."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        outs = list(next(n for n in self.gm.graph.nodes if n.op == "output").args[0])
        k, m = self.num_outputs, len(self.mutated_primals)
        return (placeholders[:self.num_primals], placeholders[self.num_primals:], outs[:k], outs[k:k + m],
                outs[k + m:])


def _checkpointed_block_changing_state(gm: torch.fx.GraphModule) -> str | None:
    """A `checkpoint(block, ...)` call (capture/checkpoint.py) whose block draws random numbers or
    changes tensors in place: its recompute in the backward must replay eager's random state and
    writes, which the joint trace does not; such a graph runs as captured, under eager's checkpoint."""
    import torch.utils.checkpoint

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.utils.checkpoint.checkpoint:
            continue
        block = gm.get_submodule(node.args[0].target)
        for inner in block.graph.nodes:
            if inner.op == "call_module":
                module = block.get_submodule(inner.target)
                if any(True for _ in module.buffers()) or module_draws_random(module):
                    return f"its {type(module).__name__} updates buffers or draws random numbers"
            elif inner.op in ("call_function", "call_method") and not is_pure_node(inner):
                return f"it calls {target_name(inner.target)}"
    return None


def trace_joint(gm: torch.fx.GraphModule, state: list[ModuleState], primals: list[torch.Tensor]) -> JointGraph:
    """Trace forward + backward of `gm` run with `primals` = state values + tensor inputs."""
    changing = _checkpointed_block_changing_state(gm)
    if changing is not None:
        raise FunctionalizationError(f"a checkpointed block changes state ({changing}): its recompute runs under "
                                     "eager's checkpoint")
    n_state = len(state)
    # inputs of symbolic sizes (backends/weld_symbolic.py) are fakes of a mode whose ShapeEnv
    # records what the trace assumes about their sizes: traced in that mode, on fresh leaves of it
    given = next((p.fake_mode for p in primals if isinstance(p, FakeTensor)), None)
    recorder = AtenRecorder(JOINT_DECOMPOSITIONS)
    grad_primals = [i for i, p in enumerate(primals) if isinstance(p, torch.Tensor) and p.requires_grad]
    with given or FakeTensorMode(allow_non_fake_inputs=True) as mode:
        prims = [recorder.placeholder(_primal_of(mode, p)) for p in primals]
        versions = [p._version if isinstance(p, torch.Tensor) else None for p in prims]
        with recorder, substituted(gm, state, prims[:n_state]):
            flat_out, out_spec = pytree.tree_flatten(gm(*prims[n_state:]))
        for p, version in zip(prims, versions):
            if version is not None and p._version != version and p.requires_grad:
                # `h[mask] = self.embed` on an input: the gradient to `embed` runs through that
                # input's autograd history, outside this graph, where the write-back cannot put it
                raise FunctionalizationError("the graph changes in place an input that autograd tracks "
                                             "(a later gradient flows through that change)")
        prim_ids = {id(p) for p in prims}
        if any(isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is None and id(o) not in prim_ids
               for o in flat_out):
            # `with no_grad(): v = h.narrow(...)` of a tracked h, returned: autograd says v requires
            # grad but gives it no history; a custom Function's output cannot be such a view
            raise FunctionalizationError("an output is a view made under no_grad of a tensor autograd tracks")
        diff_outputs = [i for i, o in enumerate(flat_out) if isinstance(o, torch.Tensor) and o.requires_grad]
        aliases = {i: found for i, o in enumerate(flat_out) if (found := _primal_alias(o, prims)) is not None}
        if given is not None and any(map(_symbolic_numbers, aliases.values())):
            # the runtime takes such a view again at each call from numbers it keeps
            raise FunctionalizationError("an output views an input at symbolic sizes")
        input_views = frozenset(i for i, o in enumerate(flat_out)
                                if isinstance(o, torch.Tensor) and o._is_view()
                                and (id(o._base) in prim_ids or (i in aliases and o is not prims[aliases[i][0]])))
        # one tangent input per output that needs a gradient, after the primals
        tangents = [recorder.placeholder(torch.empty(flat_out[i].shape, dtype=flat_out[i].dtype,
                                                     device=flat_out[i].device)) for i in diff_outputs]
        diff, wrt = [flat_out[i] for i in diff_outputs], [prims[i] for i in grad_primals]
        with recorder, substituted(gm, state, prims[:n_state]):  # a checkpointed region recomputes here
            try:
                grads = torch.autograd.grad(diff, wrt, tangents, allow_unused=True) if diff and wrt else [None] * len(wrt)
            except RuntimeError as e:
                if "modified by an inplace operation" not in str(e):
                    raise
                # `t = maximum(x, w); w[1:] = 0`: eager's forward runs, and only a backward through t
                # would fail, where the joint trace runs that backward now
                raise FunctionalizationError("the graph changes in place a tensor an earlier op saved for "
                                             "backward") from e
    traced = recorder.graph_module([*flat_out, *grads])
    # functionalize appends new values after all outputs; move them before the grads.
    with torch.no_grad():  # a rewrite of the recorded graph: autograd's view rules (a view made
        fn = functionalize(traced)  # under no_grad, written after) are the recording's business
    smaller_saves(fn.gm.graph)
    run_aten_passes(fn.gm.graph)
    output = next(n for n in fn.gm.graph.nodes if n.op == "output")
    flat = list(output.args[0])
    k, g = len(flat_out), len(grad_primals)
    outs, grads, new_values = flat[:k], flat[k:k + g], flat[k + g:]
    output.args = ([*outs, *new_values, *grads],)
    fn.gm.recompile()
    resident = frozenset(i for i, p in enumerate(primals) if i < n_state or isinstance(p, torch.nn.Parameter))
    itself = {i: alias[0] for i, alias in aliases.items() if flat_out[i] is prims[alias[0]]}
    written = {i: alias for i, alias in aliases.items() if alias[0] in fn.mutated_placeholders and i not in itself}
    views = {i: alias for i, alias in aliases.items() if i not in itself and i not in written}
    return JointGraph(fn.gm, len(primals), k, out_spec, diff_outputs, fn.mutated_placeholders, grad_primals,
                      resident, input_views, written, itself, views)


def _primal_of(mode: FakeTensorMode, value):
    """What the trace runs the graph on for `value`: a fake tensor of `mode`, or an int argument
    over symbols as it is (a SymInt of the mode's ShapeEnv, which ops take as an argument)."""
    if isinstance(value, torch.SymInt):
        return value
    return _fresh_leaf(value) if isinstance(value, FakeTensor) else fake_copy(mode, value)


def _fresh_leaf(fake: FakeTensor) -> torch.Tensor:
    """A new fake leaf of `fake`'s mode with its (symbolic) sizes, strides, dtype, device and
    requires_grad: the trace's autograd history starts at it."""
    leaf = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)
    return leaf.requires_grad_(fake.requires_grad)


def _symbolic_numbers(values: tuple) -> bool:
    """Whether `values` (an alias's sizes, strides and offset) hold a symbolic size."""
    return any(isinstance(n, torch.SymInt) for n in pytree.tree_leaves(values))


def _primal_alias(out: object, prims: list) -> tuple[int, tuple, tuple, int] | None:
    """(primal index, sizes, strides, storage offset less the primal's) where the traced
    output `out` is a primal or a view of one; else None. A primal that is itself a view (the
    caller's `big[1:]`) has the same `_base` as its views: the one primal sharing `out`'s
    memory is the one it views."""
    if not isinstance(out, torch.Tensor) or out.layout is not torch.strided:
        return None
    base = out._base if out._is_view() else out
    found = [j for j, p in enumerate(prims) if p is out] or [j for j, p in enumerate(prims) if p is base]
    if not found and out._is_view():
        storage = out.untyped_storage()._cdata
        found = [j for j, p in enumerate(prims) if isinstance(p, torch.Tensor) and p._is_view()
                 and p.layout is torch.strided and p.untyped_storage()._cdata == storage]
    if len(found) != 1:
        return None
    p = prims[found[0]]
    return found[0], tuple(out.shape), tuple(out.stride()), out.storage_offset() - p.storage_offset()
