"""Activation checkpointing in one graph: `torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=False)`.

torch marks `checkpoint` to run without compilers, so a call of it used to break the graph and
run the block uncompiled. Capture instead inlines `fn` as any function (its operations join the
graph, guarded as usual), then moves the operations it recorded into a submodule, and calls
`checkpoint(submodule, *inputs, use_reentrant=False)` in their place. The graph so keeps eager's
semantics for any backend: the block's activations are not saved but recomputed in the backward,
with the random-number state the forward had (checkpoint's `preserve_rng_state`), and a module
buffer the block updates (batch norm's running statistics) is updated as eager updates it. weld
traces through the call: its backward graph holds the recomputed block.

The block's operations stay in the graph as well, marked `checkpoint_region`; dead-code removal
drops them once nothing else reads them (their only readers were the returned values, which now
come from the checkpoint call).

Not captured (the call breaks the graph and runs as before, the reason in the logs): the
reentrant variant (`use_reentrant=True`, or left unset), a `context_fn`, a block that changes
Python state outside the frame (its recompute would change it again, in eager), a block that
returns anything but tensors, constants and tuples or lists of them, a block with a graph break.
"""
from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from torchweld.capture.values import ConstantValue, ListValue, TensorValue, TupleValue, Value
from torchweld.errors import Unsupported
from torchweld.node_effects import draws_random, is_pure_node, target_name

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

REGION = "checkpoint_region"  # node.meta key: the checkpoint call that replays this node
_SUPPORTED_OPTIONS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug"}
_regions = itertools.count()


def is_checkpoint(obj: object) -> bool:
    return obj is torch.utils.checkpoint.checkpoint


class CheckpointValue(Value):
    """`torch.utils.checkpoint.checkpoint` itself."""

    def __init__(self, source=None):
        self.source = source

    def real_object(self) -> object:
        return torch.utils.checkpoint.checkpoint

    def python_type(self) -> type:
        return type(torch.utils.checkpoint.checkpoint)

    def as_constant(self) -> object:
        return torch.utils.checkpoint.checkpoint

    def call(self, tx: "Translator", args: list[Value], kwargs: dict[str, Value]) -> Value:
        options = _options(kwargs)
        if not args:
            raise Unsupported("torch.utils.checkpoint.checkpoint() called without a function")
        fn, fn_args = args[0], args[1:]
        output = tx.output
        graph = output.graph
        existing = set(graph.nodes)
        before = output.side_effects.snapshot()
        result = fn.call(tx, list(fn_args), {})
        if output.side_effects.snapshot() != before:
            raise Unsupported("a checkpointed function changes Python state outside the frame (its recompute "
                              "in the backward would change it again): it runs with eager's checkpoint")
        region = [n for n in graph.nodes if n not in existing and n.op != "placeholder"]
        if not region:
            return result
        arguments = {a.node for a in fn_args if isinstance(a, TensorValue)}
        written = next((n for n in region if _writes_outside(n, set(region), arguments)), None)
        if written is not None:
            raise Unsupported(f"a checkpointed function changes in place ({target_name(written.target)}) a tensor it "
                              "reads from outside, not one of its arguments: it runs with eager's checkpoint")
        tag = next(_regions)
        for node in region:
            node.meta[REGION] = tag
        return _outline(output, region, result, options, tag)


def _options(kwargs: dict[str, Value]) -> dict:
    options = {}
    for name, value in kwargs.items():
        if name not in _SUPPORTED_OPTIONS:
            raise Unsupported(f"checkpoint(..., {name}=...) is not captured: the block runs with eager's checkpoint")
        if not isinstance(value, ConstantValue):
            raise Unsupported(f"checkpoint(..., {name}=...) with a value known only at run time")
        options[name] = value.as_constant()  # a number read from outside is guarded
    if options.get("use_reentrant") is not False:
        raise Unsupported("checkpoint(..., use_reentrant=True) (or unset) is not captured: the block runs with "
                          "eager's checkpoint; pass use_reentrant=False, as PyTorch recommends")
    return options


# views a block may write through: the write lands in what they view
_VIEWS = {"view", "reshape", "transpose", "permute", "select", "narrow", "unsqueeze", "squeeze", "expand",
          "as_strided", "flatten", "unflatten", "view_as", "t", "detach", "__getitem__", "getitem", "diagonal"}


def _writes_outside(node: torch.fx.Node, inside: set, arguments: set) -> bool:
    """Whether `node` changes in place a tensor from outside the block that is not one of the
    checkpoint's arguments (a closure's tensor): outlined, it would become an argument, and the
    recompute would fail autograd's check of saved tensors where eager's checkpoint does not."""
    if node.op not in ("call_function", "call_method") or is_pure_node(node) \
            or draws_random(target_name(node.target)) and not target_name(node.target).endswith("_"):
        return False
    written = node.kwargs.get("out", node.args[0] if node.args else None)
    while isinstance(written, torch.fx.Node) and written in inside and target_name(written.target) in _VIEWS \
            and written.args:
        written = written.args[0]
    return isinstance(written, torch.fx.Node) and written not in inside and written not in arguments


def _outline(output, region: list[torch.fx.Node], result: Value, options: dict, tag: int) -> Value:
    """Move `region` into a submodule called through checkpoint; `result` rebuilt from its outputs."""
    leaves = _result_tensors(result)
    inside = set(region)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    outside_inputs: list[torch.fx.Node] = []
    for node in region:  # the values the block reads from before it: the submodule's inputs
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.fx.Node) and arg not in inside and arg not in env:
                env[arg] = sub.placeholder(f"input_{len(outside_inputs)}")
                env[arg].meta["example_value"] = arg.meta.get("example_value")
                outside_inputs.append(arg)
    for leaf in leaves:  # a returned input: the submodule passes it through
        if leaf.node not in inside and leaf.node not in env:
            env[leaf.node] = sub.placeholder(f"input_{len(outside_inputs)}")
            env[leaf.node].meta["example_value"] = leaf.fake
            outside_inputs.append(leaf.node)
    for node in region:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[leaf.node] for leaf in leaves))
    name = f"checkpointed_{tag}"
    output.root.add_module(name, torch.fx.GraphModule(output.root, sub, class_name="CheckpointedBlock"))
    graph = output.graph
    module_node = graph.get_attr(name)
    call = graph.call_function(torch.utils.checkpoint.checkpoint, (module_node, *outside_inputs), options)
    call.meta["example_value"] = tuple(leaf.fake for leaf in leaves)
    replaced = {}
    for i, leaf in enumerate(leaves):
        item = graph.call_function(operator.getitem, (call, i))
        item.meta["example_value"] = leaf.fake
        replaced[id(leaf)] = TensorValue(item, leaf.fake, cls=leaf.cls)
    return _rebuilt(result, replaced)


def _result_tensors(result: Value) -> list[TensorValue]:
    if isinstance(result, TensorValue):
        return [result]
    if isinstance(result, (TupleValue, ListValue)):
        tensors = []
        for item in result.elements:
            if isinstance(item, TensorValue):
                tensors.append(item)
            elif not isinstance(item, ConstantValue):
                raise Unsupported(f"a checkpointed function returned a {item.python_type().__name__} in a sequence")
        return tensors
    if isinstance(result, ConstantValue):
        return []
    raise Unsupported(f"a checkpointed function returned a {result.python_type().__name__}")


def _rebuilt(result: Value, replaced: dict[int, TensorValue]) -> Value:
    if isinstance(result, TensorValue):
        return replaced[id(result)]
    if isinstance(result, TupleValue):
        return TupleValue([replaced.get(id(v), v) for v in result.elements], fields=result.fields,
                          tuple_type=result.tuple_type)
    if isinstance(result, ListValue):
        return ListValue([replaced.get(id(v), v) for v in result.elements])
    return result
