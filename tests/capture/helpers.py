"""Compare torchweld's capture with eager and with torch.compile (the anchor)."""
from __future__ import annotations

import copy

import torch

import torchweld

OP_KINDS = ("call_function", "call_method", "call_module")


class CountingBackend:
    """Records each graph a compiler hands to its backend; runs it eagerly."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    @property
    def op_counts(self) -> list[int]:
        return [sum(1 for n in g.graph.nodes if n.op in OP_KINDS and not _is_grad_toggle(n)) for g in self.graphs]


def _is_grad_toggle(node) -> bool:
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def torch_compile_counts(fn, *args, **kwargs) -> tuple[int, list[int]]:
    """(graphs, ops per graph) that torch.compile captures for one call."""
    torch._dynamo.reset()
    backend = CountingBackend()
    torch.compile(fn, backend=backend)(*args, **kwargs)
    torch._dynamo.reset()
    return len(backend.graphs), backend.op_counts


def assert_same(compiled_out, eager_out):
    """Same structure, tensors close, every other leaf equal."""
    ours, our_spec = torch.utils._pytree.tree_flatten(compiled_out)
    theirs, their_spec = torch.utils._pytree.tree_flatten(eager_out)
    assert our_spec == their_spec, f"{our_spec} != {their_spec}"
    for a, b in zip(ours, theirs):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, equal_nan=True)
        else:
            assert type(a) is type(b) and a == b, f"{a!r} != {b!r}"


def check_program(fn, *calls, compare_counts=True, fresh=None):
    """Run `fn` compiled and eager on each argument tuple in `calls` (later ones are
    meant to fail a guard); the results must match, and the first call's graphs and
    op counts must equal torch.compile's."""
    backend = CountingBackend()
    compiled = torchweld.compile(fn, backend=backend)
    for args in calls:
        eager_args = copy.deepcopy(args)
        assert_same(compiled(*args), fn(*eager_args))
        assert_same(args, eager_args)  # in-place changes to inputs match too
    if compare_counts:
        compare_with_torch_compile(fn, calls[0])
    return compiled, backend


def compare_with_torch_compile(fn, args, max_graphs: int | None = None):
    """As many graphs as torch.compile (or `max_graphs`), none with more operations than
    torch.compile's matching graph (torchweld drops unused pure operations; dynamo may not)."""
    ours = CountingBackend()
    torchweld.compile(fn, backend=ours)(*copy.deepcopy(args))
    graphs, op_counts = torch_compile_counts(fn, *copy.deepcopy(args))
    message = f"torchweld {len(ours.graphs), ours.op_counts} vs torch.compile {graphs, op_counts}"
    assert len(ours.graphs) == (graphs if max_graphs is None else max_graphs), message
    if max_graphs is None:
        assert all(a <= b for a, b in zip(ours.op_counts, op_counts)), message
    return ours, (graphs, op_counts)
