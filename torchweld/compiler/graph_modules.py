"""GraphModules for weld's own graphs (aten graphs, the joint graph, its partitions),
whose Python code is generated only when something reads or calls it.

`torch.fx.GraphModule(root, graph)` generates and compiles the graph's Python source at
once, and again at each `recompile()`: for a 3000-node joint graph ~0.1 s each time,
though weld only walks these graphs' nodes (lowering) and calls one only where it falls
back to running its aten ops eagerly. torch.fx's lazy GraphModule defers that work to
the first call or read of `.code`; it is a GraphModule in every other respect.

    gm = graph_module(root, graph)   # no code generated yet
    gm.recompile()                   # marks it stale, generates nothing
    gm(*args)                        # generates and compiles the code, then runs it
"""
from __future__ import annotations

import torch

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # a torch without it: code generated eagerly, as before
    _GraphModule = torch.fx.GraphModule


def graph_module(root: torch.nn.Module | dict, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule of `graph` over `root`'s attributes, its code generated on first use."""
    return _GraphModule(root, graph)
