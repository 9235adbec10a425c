"""What weld's lowering makes of a function on fake tensors, without running it: for tests of
which kernel a lowering rule picks on a device this machine may not have (fake CUDA tensors
need no GPU)."""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.lowering import GraphLowering


def lowered_externs(fn: Callable, make_args: Callable[[], list[torch.Tensor]], cuda_graphs: bool = False) -> list[str]:
    """The extern calls (aten ops and torchweld's own) of `fn` lowered for the tensors
    `make_args()` creates, which it does under a FakeTensorMode; `cuda_graphs`: lowered for
    a graph CUDA graphs will replay."""
    gm = torch.fx.symbolic_trace(fn)
    with FakeTensorMode():
        args = make_args()
        aten_graph = to_aten_graph(gm, args)
        lowering = GraphLowering(aten_graph.gm, check=lambda buf: None, bias_in_kernel=lambda d: True,
                                 split_reductions=lambda d: True, cuda_graphs=cuda_graphs)
        return lowering.run(args, None).externs
