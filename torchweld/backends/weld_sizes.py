"""weld for a graph with symbolic sizes, compiled once per concrete layout: where weld cannot
compile it over its symbols (weld_symbolic.py: training graphs, a symbolic int argument, ...),
or for a call outside what that compile assumed.

Capture hands weld the symbolic graph once; a call whose inputs have sizes and strides not seen before runs the
graph as captured (eager's kernels), and the next call with those sizes
(tuning.specialize_at_call) gets a copy of the graph whose example values hold them
(`static_copy`), compiled as any static graph is, and kept. At most
options={"size_specializations": n} sizes are compiled (default tuning.default_specializations);
later sizes run as captured, and a log line says so once (no size is dropped and compiled
again: a cache that evicted thrashed, a compile every call). So sizes seen once (a generation
loop whose length grows by one a call) cost no compile, and one that repeats (a padded batch
length) runs weld's kernels from its second call. The specializations' kernels take their
integers as arguments (option sizes_as_arguments): Triton kernels that differ only in sizes
are compiled once, and so are C++ libraries. The guard capture
made for the symbolic graph decides which calls reach here; the cache key decides which
specialization runs, so a specialization is never used for sizes it was not compiled for:
the symbols' values, read from the inputs, where capture's guards fix every other size
(`symbol_reads`); else every input's sizes and strides.
"""
from __future__ import annotations

import collections
from typing import Callable

import sympy
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from torchweld import logs
from torchweld.backends.weld_declines import is_symbolic
from torchweld.capture.symbolic_sizes import SIZES_GUARDED, SYMBOLIC_TYPES
from torchweld.tuning import tuning


def _layout(args: tuple) -> tuple:
    """What a specialization was compiled for: each tensor's sizes and strides, each number itself
    (torch.compile's graphs take symbolic sizes as arguments too)."""
    return tuple((tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) and a.layout is torch.strided
                 else (tuple(a.shape) if isinstance(a, torch.Tensor) else (type(a), a)) for a in args)


def symbol_reads(gm: torch.fx.GraphModule) -> list[tuple[int, int]] | None:
    """(input position, dim) where each symbol of the graph's input sizes is first read: the key
    of a call, for a graph whose other sizes capture's guards fix (SIZES_GUARDED; strides the
    wrapper restrides where they differ); None for any other graph (a number among its inputs)."""
    if not gm.meta.get(SIZES_GUARDED):
        return None
    reads, seen = [], set()
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        fake = node.meta.get("example_value")
        if not isinstance(fake, torch.Tensor):
            return None
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and size.node.expr not in seen:
                seen.add(size.node.expr)
                reads.append((i, d))
    return reads


def bindings(gm: torch.fx.GraphModule, args: tuple) -> dict:
    """{symbol: its value in this call}, read from the placeholders' symbolic sizes and `args`."""
    found: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(placeholders, args):
        fake = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(fake, torch.SymInt) and isinstance(fake.node.expr, sympy.Symbol) and type(arg) is int:
            found[fake.node.expr] = sympy.Integer(arg)  # a symbolic size passed as a number (torch.compile's graphs)
            continue
        if not isinstance(fake, torch.Tensor) or not isinstance(arg, torch.Tensor):
            continue
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                found[size.node.expr] = sympy.Integer(arg.shape[d])
    return found


def _concrete(n: object, env, values: dict) -> object:
    if not isinstance(n, SYMBOLIC_TYPES):
        return n
    expr = env.replace(n.node.expr) if env is not None else n.node.expr
    value = expr.xreplace(values)
    if value.free_symbols:
        raise ValueError(f"the size {n} names a symbol no input binds")
    if isinstance(n, torch.SymInt):
        return int(value)
    return bool(value) if isinstance(n, torch.SymBool) else float(value)


def static_copy(gm: torch.fx.GraphModule, args: tuple) -> torch.fx.GraphModule:
    """A copy of `gm` (same modules, same code) whose example values have this call's sizes."""
    values = bindings(gm, args)
    graph = torch.fx.Graph()
    mapping: dict = {}
    out = graph.graph_copy(gm.graph, mapping)
    graph.output(out)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}

    def concrete(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.layout is torch.strided and is_symbolic(value):
            if id(value) not in made:
                env = next((n.node.shape_env for n in (*value.shape, *value.stride())
                            if isinstance(n, torch.SymInt)), None)
                sizes = [_concrete(n, env, values) for n in value.shape]
                strides = [_concrete(n, env, values) for n in value.stride()]
                with mode:
                    fake = torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)
                if value.requires_grad:
                    fake.requires_grad_(True)
                made[id(value)] = fake
            return made[id(value)]
        if isinstance(value, SYMBOLIC_TYPES):
            return _concrete(value, value.node.shape_env, values)
        return value

    for old, new in mapping.items():
        if "example_value" in old.meta:
            new.meta["example_value"] = pytree.tree_map(concrete, old.meta["example_value"])
    return torch.fx.GraphModule(gm, graph)


class CompiledPerSize:
    """Calls the specialization of `gm` compiled for the sizes and strides of its arguments."""

    def __init__(self, gm: torch.fx.GraphModule, compile_static: Callable, limit: int | None = None):
        self.gm = gm
        self.compile_static = compile_static  # (static graph module, example inputs) -> callable
        self.limit = tuning.default_specializations if limit is None else limit
        self.specializations: dict[tuple, Callable] = {}
        self.compiles = 0
        self._reads = symbol_reads(gm)
        self._sizes: dict[tuple, list] = {}  # key -> its inputs' sizes, for the log
        self._calls: collections.OrderedDict = collections.OrderedDict()  # key not compiled -> its calls so far
        self.calls_as_captured = 0
        self._told_full = False

    def __call__(self, *args):
        # the symbols' values (0.5 us), where capture's guards fix the rest; else every layout (2 us)
        key = _layout(args) if self._reads is None else tuple([args[i].shape[d] for i, d in self._reads])
        compiled = self.specializations.get(key)
        if compiled is not None:
            return compiled(*args)
        calls = self._calls.pop(key, 0) + 1
        if calls >= tuning.specialize_at_call and self.compiles < self.limit:
            return self._compile(key, args)(*args)
        self._calls[key] = calls
        if len(self._calls) > 4 * self.limit:  # the sizes seen least recently are forgotten
            self._calls.popitem(last=False)
        if calls >= tuning.specialize_at_call and not self._told_full:
            self._told_full = True
            logs.get("dynamic").info("weld has compiled this graph for %d sizes (options size_specializations): "
                                     "other sizes run as captured, with eager's kernels; sizes compiled: %s",
                                     self.limit, list(self._sizes.values()))
        self.calls_as_captured += 1
        return self.gm(*args)

    def _compile(self, key: tuple, args: tuple) -> Callable:
        compiled = self.compile_static(static_copy(self.gm, args), list(args))
        self.compiles += 1
        self.specializations[key] = compiled
        self._sizes[key] = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        return compiled
