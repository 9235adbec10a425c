"""A graph that raises at run time before it changed anything outside: the frame runs again
eagerly, so the call ends as eager's would.

A graph runs before the Python side effects it was captured among are replayed, and
outside any `try` of the user's code. An error the fake run could not foresee (a value out
of range, an operation a kernel does not implement for a dtype) would then skip the user's
`except`, and the side effects made before it. Where the graph changes nothing (no
in-place change of an input or of a view of one, no module buffer updated), nothing has
happened yet when it raises: the frame is run again as plain Python, which raises the
error at the user's line (or handles it, as the user wrote), after its side effects.
A graph that draws random numbers has its generators' states saved before each call and
restored for the rerun. A graph that changes inputs in place has their version counters
saved before each call: if it raised before the first write (`x.add_(y)` refused because y
overlaps x), they are unchanged and the frame runs again; after a write, the error propagates
as is (a graph that changes a module's buffers, likewise).
"""
from __future__ import annotations

import dataclasses
import dis
import types
import warnings

import torch

from torchweld import logs
from torchweld.node_effects import draws_random, is_pure_node, module_draws_random, target_name


@dataclasses.dataclass(frozen=True)
class RerunPlan:
    """What the entry saves before the graph runs, so that a frame whose graph raised can be
    run again eagerly: the random generators' states, and the version counters of the inputs
    the graph changes in place (unchanged when it raised: no write had happened yet)."""

    generators: list[torch.Generator]
    written_inputs: tuple[int, ...]  # positions of the graph's inputs it changes in place


def rerun_plan(gm: torch.fx.GraphModule) -> RerunPlan | None:
    """Where running `gm` up to any node changes nothing a second run would see but the state
    of random generators and inputs changed in place (each write bumps the input's version
    counter, which its views share): what to save; None where it changes more (a module's
    buffers, a tensor whose storage is not an input's)."""
    devices: set[torch.device] = set()
    inputs = _input_storages(gm)
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if not _module_changes_nothing(module):
                return None
            if module_draws_random(module):
                devices.update(_devices_of(node))
        elif node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            continue  # the rerun starts in the frame's own grad mode (EagerRerun restores it)
        elif node.op in ("call_function", "call_method") and not is_pure_node(node):
            name = target_name(node.target)
            changed = node.kwargs.get("out", node.args[0] if node.args else None)
            if draws_random(name) and not (name.endswith("_") or "out" in node.kwargs or node.kwargs.get("inplace")):
                devices.update(_devices_of(node))
            elif not _is_intermediate(changed, inputs):  # an in-place change of an input, or a view of one
                position = _input_position(changed, inputs)
                if position is None:
                    return None
                written.add(position)
    return RerunPlan([_generator(d) for d in sorted(devices, key=str)], tuple(sorted(written)))


def _input_position(changed: object, inputs: list | None) -> int | None:
    """The position of the graph input whose storage `changed` (a node) writes, or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    example = changed.meta.get("example_value") if isinstance(changed, torch.fx.Node) else None
    if inputs is None or not isinstance(example, torch.Tensor):
        return None
    try:
        storage = StorageWeakRef(example.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None
    found = [i for i, s in enumerate(inputs) if s == storage]
    return found[0] if len(found) == 1 else None


def _input_storages(gm: torch.fx.GraphModule) -> list | None:
    """The storages of the graph's inputs in order (as their example values hold them); None if unknown."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            example = node.meta.get("example_value")
            if not isinstance(example, torch.Tensor) or example.layout is not torch.strided:  # sparse: no storage
                return None
            storages.append(StorageWeakRef(example.untyped_storage()))
    return storages


def _is_intermediate(changed: object, inputs: list | None) -> bool:
    """Whether what an in-place operation changes is a tensor the graph made (its example value
    shares no storage with an input: views share their base's), so a second run sees nothing."""
    from torch.multiprocessing.reductions import StorageWeakRef

    example = changed.meta.get("example_value") if isinstance(changed, torch.fx.Node) else None
    if inputs is None or not isinstance(example, torch.Tensor):
        return False
    try:
        return StorageWeakRef(example.untyped_storage()) not in inputs
    except (RuntimeError, NotImplementedError):
        return False


def _module_changes_nothing(module: torch.nn.Module) -> bool:
    """No buffers to update (batch norm's running statistics), nothing changed in place."""
    return all(not any(b is not None for b in m._buffers.values()) and not getattr(m, "inplace", False)
               for m in module.modules())


def _devices_of(node: torch.fx.Node) -> set[torch.device]:
    return {t.device for t in torch.utils._pytree.tree_leaves(node.meta.get("example_value"))
            if isinstance(t, torch.Tensor)}


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class EagerRerun:
    """Called with the graph's error and the frame's arguments: runs the frame as plain Python."""

    def __init__(self, fn: types.FunctionType, plan: RerunPlan, grad_enabled: bool):
        self.fn = fn
        self.generators = plan.generators
        self.grad_enabled = grad_enabled  # the mode the frame starts in (its guard holds it)
        self.catches = catches_exceptions(fn.__code__)

    def save(self) -> list[torch.Tensor]:
        """The generators' states before the graph: the rerun draws what eager draws."""
        return [g.get_state() for g in self.generators]

    def __call__(self, error: Exception, states: list[torch.Tensor] | None, *args, **kwargs):
        for generator, state in zip(self.generators, states or ()):
            generator.set_state(state)
        torch._C._set_grad_enabled(self.grad_enabled)  # a `with torch.no_grad()` in the graph may have left it
        name = self.fn.__code__.co_qualname
        logs.get("graph_breaks").info("the graph of %s raised %s: %s; running the frame eagerly, as eager does",
                                      name, type(error).__name__, error)
        result = self.fn(*args, **kwargs)
        if not self.catches:  # nothing of the user's could have handled it: the graph was wrong to raise
            warnings.warn(f"torchweld: the compiled graph of {name} raised {type(error).__name__} ({error}), and "
                          "the frame run eagerly did not: this call's result is eager's. Please report this.",
                          stacklevel=2)
        return result


def catches_exceptions(code: types.CodeType) -> bool:
    """Whether the function has a `try` of its own (a `with` block's cleanup is not one)."""
    from torchweld.capture.graph_break import inside_try

    return any(inside_try(code, inst.offset) for inst in dis.get_instructions(code))
