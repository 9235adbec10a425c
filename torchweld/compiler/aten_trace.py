"""Record the aten ops a function runs on fake tensors as an FX graph.

torch's `make_fx` does this through its proxy-tensor machinery (a proxy per tensor,
pytree over every argument, metadata snapshots), which costs more per op than the
fake-tensor kernels themselves. AtenRecorder is the part weld needs, as one
TorchDispatchMode stacked above a FakeTensorMode: every aten op that reaches it is
decomposed (the table weld gives it, or the op's CompositeImplicitAutograd kernel
where autograd would have used that) or run on the fake tensors below it and
recorded as one node with its fake result in `meta["val"]`. Real tensors an op
reads (tensor literals), and fakes registered as standing for real ones
(parameters and buffers, `constant`), become get_attr constants.

    recorder = AtenRecorder(decompositions)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        xs = [recorder.placeholder(fake_copy(mode, x)) for x in inputs]
        with recorder:
            out = fn(*xs)
    gm = recorder.graph_module(flat_outputs)

An op whose result's shape depends on tensor data (`nonzero`) fails as it does under fake
tensors, and the caller falls back. Over symbolic sizes (placeholders whose sizes are SymInts),
scaled_dot_product_attention, matmul and pad run under the Python dispatcher (`_CompositesOverSymbols`).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchweld import fake_memo
from torchweld.compiler.graph_modules import graph_module
from torchweld.tuning import tuning

aten = torch.ops.aten

# Ops that read tensor metadata only, never decomposed (as make_fx leaves them).
_METADATA_OPS = frozenset({aten.size.default, aten.stride.default, aten.storage_offset.default})
_CIA = "CompositeImplicitAutograd"
_has_cia: dict[object, bool] = {}  # op -> whether it has a CompositeImplicitAutograd kernel (and may decompose)
_decomposes: dict[tuple, bool] = {}  # (op, device type) -> whether autograd would have decomposed it

# the attribute names of the tensors a recording holds as constants (get_attr nodes)
CONSTANT_PREFIX = "_tensor_constant"


def autograd_decomposes(func, args, kwargs) -> bool:
    """Whether autograd would have run `func`'s CompositeImplicitAutograd kernel for these
    arguments: it has one, and no kernel of its own for the first tensor's device. Ops reach
    a dispatch mode undecomposed when called from below autograd (inside a decomposition),
    and make_fx decomposes them there alike (torch.utils._python_dispatch.autograd_would_have_decomposed)."""
    has_cia = _has_cia.get(func)
    if has_cia is None:
        has_cia = _has_cia[func] = (func not in _METADATA_OPS
                                    and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _CIA))
    if not has_cia:  # most ops: no look at the arguments
        return False
    device = next((a.device.type for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)), None)
    known = _decomposes.get((func, device))
    if known is None:
        known = device is None or not torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C._dispatch_key_for_device(device))
        _decomposes[(func, device)] = known
    return known


# C++ composites that read symbolic sizes as ints on some torch versions; over symbols they run
# under the Python dispatcher (_CompositesOverSymbols)
_PYTHON_KERNELS_OVER_SYMBOLS = frozenset({
    F.scaled_dot_product_attention, F.pad,
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch._C.TensorBase.matmul,
})


class _CompositesOverSymbols(TorchFunctionMode):
    """Runs scaled_dot_product_attention, matmul and pad under the Python dispatcher, as capture
    runs every op over symbols (output_graph._run_fake) and make_fx its symbolic traces. They are
    C++ composites, which decompose above the recorder, and some of their C++ paths read symbolic
    sizes as ints (`aten.size` through the fake mode), guarding each equal to its hint, which
    makes the compile over symbols one per size (bench/investigations/pinned_symbols.py names the
    torch function where that happens):
      - attention's memory-efficient path on CUDA pads the mask (`pad_bias`: rows aligned to 8)
        with constant_pad_nd, whose C++ meta kernel takes the pads as ints ("SymIntArrayRef
        expected to contain only concrete integers"); its math path (a mask it cannot align:
        BERT's, broadcast) runs C++ matmul;
      - under torch 2.11, a plain `q @ k.transpose(-2, -1)` in a training step's joint trace;
      - under torch 2.13, `F.pad` (transformers' causal LM loss pads its labels): constant_pad_nd.
    The Python dispatcher takes the Python meta and matmul kernels torch registers for symbolic
    sizes instead, which decide on sizes through the ShapeEnv (guards). Other ops trace as
    without symbols. Attention in inference may be recorded as one opaque op instead
    (runtime/opaque_attention.py, where tuning.opaque_attention_over_symbols asks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _PYTHON_KERNELS_OVER_SYMBOLS:
            return func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention and tuning.opaque_attention_over_symbols:
            from torchweld.runtime import opaque_attention

            if opaque_attention.applies(args, kwargs or {}):
                return opaque_attention.call(args, kwargs or {})
        with enable_python_dispatcher():
            return func(*args, **(kwargs or {}))


class AtenRecorder(TorchDispatchMode):
    """Records each aten op that reaches it into `self.graph` (see the module docstring)."""

    def __init__(self, decompositions: dict):
        super().__init__()
        self.decompositions = decompositions
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()  # holds the get_attr constants
        self._nodes: dict[int, tuple[torch.Tensor, torch.fx.Node]] = {}  # id(tensor) -> (tensor, node)
        self._constants = 0  # get_attr constants so far, for their names
        self._reals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(fake) -> (fake, real it stands for)
        self._placeholders: list[torch.fx.Node] = []
        # id(detach's result) -> (that result, its input): recorded as its input's node, but a
        # graph output that eager returns as a tensor object of its own (`graph_module`)
        self._detached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._over_symbols = False  # a placeholder's sizes are SymInts
        self._composites = _CompositesOverSymbols()  # on in the outermost `with self`, over symbols
        self._composites_on = False
        self._depth = 0  # `with self` nesting

    # -- building the graph --------------------------------------------------------

    def placeholder(self, value, name: str | None = None):
        """A graph input taking `value` (a fake tensor, or anything else the graph treats as
        fixed); placeholders stay ahead of every op even when added after some were recorded."""
        name = name or f"arg{len(self._placeholders)}_1"
        # after the last placeholder, or at the start of the graph (inserting_before(None))
        last = self._placeholders[-1] if self._placeholders else None
        with self.graph.inserting_after(last) if last is not None else self.graph.inserting_before(None):
            node = self.graph.placeholder(name)
        node.meta["val"] = value
        self._placeholders.append(node)
        if isinstance(value, torch.Tensor):
            self._bind(value, node)
            self._over_symbols |= any(isinstance(n, torch.SymInt) for n in value.shape)
        return value

    def constant(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record `fake` (run in `real`'s place) as the get_attr constant `real` where an op reads it."""
        self._reals[id(fake)] = (fake, real)

    def node_of(self, value):
        """The node producing `value` (a tensor the recording saw, or a real tensor or a
        fake standing for one, which becomes a constant); anything else is returned as
        is, a literal argument."""
        if not isinstance(value, torch.Tensor):
            return value
        entry = self._nodes.get(id(value))
        if entry is not None:
            return entry[1]
        real = self._reals[id(value)][1] if id(value) in self._reals else value
        name = f"{CONSTANT_PREFIX}{self._constants}"
        self._constants += 1
        setattr(self.root, name, real)
        node = self.graph.get_attr(name)
        node.meta["val"] = real
        self._bind(value, node)
        return node

    def graph_module(self, outputs: list) -> torch.fx.GraphModule:
        """The recording as a GraphModule returning `outputs` (a flat list), dead code removed.
        An output that `detach` made is an `aten.alias` of its input's node: in eager a new
        tensor object (`x.detach() is not x`), where the node alone would return the input."""
        aliases: dict[int, torch.fx.Node] = {}
        self.graph.output([self._output_node(o, aliases) for o in outputs])
        self.graph.eliminate_dead_code()
        return graph_module(self.root, self.graph)

    def _output_node(self, value, aliases: dict[int, torch.fx.Node]):
        if not isinstance(value, torch.Tensor) or id(value) not in self._detached:
            return self.node_of(value)
        node = aliases.get(id(value))
        if node is None:
            node = aliases[id(value)] = self.graph.call_function(aten.alias.default, (self.node_of(value),))
            node.meta["val"] = value
        return node

    def _argument(self, value):
        """An op's argument as a node's: tensors become their nodes, in lists and tuples too
        (an aten op's arguments hold no other containers)."""
        if type(value) in (list, tuple):
            return type(value)(self._argument(v) for v in value)
        return self.node_of(value)

    def _bind(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        self._nodes[id(tensor)] = (tensor, node)  # the tensor is kept alive, so its id stays its own

    # -- the dispatch mode ---------------------------------------------------------

    def __enter__(self):
        if self._depth == 0 and self._over_symbols:  # (`with self` again in __torch_dispatch__: on already)
            self._composites.__enter__()
            self._composites_on = True
        self._depth += 1
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        self._depth -= 1
        if self._depth == 0 and self._composites_on:
            self._composites_on = False
            self._composites.__exit__(exc_type, exc_value, traceback)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # a tensor's device: nothing to record
            return fake_memo.run(func, args, kwargs)
        if func is aten.detach.default:  # below autograd an alias of its input: the same node
            out = func(*args, **kwargs)
            self._bind(out, self.node_of(args[0]))
            self._detached[id(out)] = (out, args[0])
            return out
        decomposition = self.decompositions.get(func)
        if decomposition is not None:
            with self:
                out = decomposition(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if autograd_decomposes(func, args, kwargs):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is aten.lift_fresh.default:  # a tensor literal: a copy, so that writes to it stay in the graph
            func = aten.lift_fresh_copy.default
        out = fake_memo.run(func, args, kwargs)  # on the fake tensors, by the FakeTensorMode below this one
        node_args = tuple(self._argument(a) for a in args)
        node_kwargs = {k: self._argument(v) for k, v in kwargs.items()}
        # (a symbolic size as an argument is what weld's lowering reads: symbols.compiling_over)
        node = self.graph.create_node("call_function", func, node_args, node_kwargs, name=func.overloadpacket.__name__)
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, value in enumerate(out):
                if isinstance(value, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), name="getitem")
                    item.meta["val"] = value
                    self._bind(value, item)
        return out
