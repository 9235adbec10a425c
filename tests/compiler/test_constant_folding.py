"""Hoisting constant-only work out of a graph (compiler/constant_folding.py)."""
import copy

import torch
import torch.nn as nn

from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.constant_folding import hoist_constants
from torchweld.passes.fuse_conv_bn import fuse_conv_bn


def folded_cnn():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    model[1].running_mean.uniform_(-1, 1)
    return model, fuse_conv_bn(model, live=True)


def test_folded_weights_are_computed_once_and_refreshed_on_change():
    model, gm = folded_cnn()
    x = torch.randn(2, 3, 6, 6)
    aten = to_aten_graph(gm, [x])
    hoisted_gm, hoisted = hoist_constants(aten.gm)
    ops = [n.target for n in hoisted_gm.graph.nodes if n.op == "call_function"]
    assert [str(op) for op in ops] == ["aten.convolution.default", "aten.relu.default"]
    assert len(hoisted.targets) == 2  # the folded weight and bias
    with torch.no_grad():
        torch.testing.assert_close(hoisted_gm(x)[0], model(x), atol=1e-5, rtol=1e-5)
        model[0].weight.mul_(2)  # bumps the version counter
        hoisted.refresh()
        torch.testing.assert_close(hoisted_gm(x)[0], model(x), atol=1e-5, rtol=1e-5)
    versions = [t._version for t in hoisted.targets]
    hoisted.refresh()  # nothing changed: nothing recomputed
    assert [t._version for t in hoisted.targets] == versions


class ViewsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w.t()


def test_graph_without_constant_work_is_unchanged():
    aten = to_aten_graph(torch.fx.symbolic_trace(ViewsOnly()), [torch.randn(2, 4)])
    gm, hoisted = hoist_constants(aten.gm)
    assert hoisted is None and gm is aten.gm  # the weight's transpose is a view: nothing to hoist


def test_a_buffer_the_graph_writes_in_place_is_not_a_constant():
    """`c.add_(1); return x + c * 2`: c * 2 read the value from before the write."""
    from torchweld.backends import lookup_backend

    aten = torch.ops.aten
    holder = nn.Module()
    holder.register_buffer("c", torch.ones(3))
    graph = torch.fx.Graph()
    x, c = graph.placeholder("x"), graph.get_attr("c")
    graph.call_function(aten.add_.Tensor, (c, 1))
    doubled = graph.call_function(aten.mul.Tensor, (c, 2))
    graph.output(graph.call_function(aten.add.Tensor, (x, doubled)))
    gm = torch.fx.GraphModule(holder, graph)
    eager_holder = nn.Module()
    eager_holder.register_buffer("c", torch.ones(3))
    eager = torch.fx.GraphModule(eager_holder, copy.deepcopy(graph))
    x = torch.randn(2, 3)
    with torch.no_grad():
        compiled = lookup_backend("weld", options={"freeze": True})(gm, [x])
        for _ in range(3):
            torch.testing.assert_close(compiled(x), eager(x))
            torch.testing.assert_close(holder.c, eager.c)
