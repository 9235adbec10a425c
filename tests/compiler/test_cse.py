"""Common subexpression elimination (compiler/cse.py): what merges, what must not."""
import copy
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweld
from torchweld.autograd import module_state, trace_joint
from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.cse import eliminate_common_subexpressions

from weld_helpers import check

aten = torch.ops.aten


def graph_of(build):
    """A graph with one placeholder `x`; `build(graph, x)` adds nodes and returns the outputs."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(tuple(build(graph, x)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def calls(gm, target=None):
    return [n for n in gm.graph.nodes if n.op == "call_function" and (target is None or n.target is target)]


def run(gm, x):
    gm.recompile()
    return gm(x)


def test_equal_pure_nodes_merge():
    def build(g, x):
        a, b = g.call_function(aten.sin.default, (x,)), g.call_function(aten.sin.default, (x,))
        return [g.call_function(aten.add.Tensor, (a, b))]
    gm = graph_of(build)
    x = torch.randn(5)
    assert eliminate_common_subexpressions(gm.graph) == 1
    assert len(calls(gm, aten.sin.default)) == 1
    torch.testing.assert_close(run(gm, x)[0], 2 * x.sin())


def test_merging_cascades_to_readers_of_merged_nodes():
    def build(g, x):
        ys = [g.call_function(aten.mul.Tensor, (g.call_function(aten.exp.default, (x,)), 2.0)) for _ in range(3)]
        return [g.call_function(aten.cat.default, (ys,))]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 4  # two exps, then the two muls reading them
    x = torch.randn(3)
    torch.testing.assert_close(run(gm, x)[0], (x.exp() * 2).repeat(3))


def test_random_draws_stay_apart():
    def build(g, x):
        a, b = g.call_function(aten.rand_like.default, (x,)), g.call_function(aten.rand_like.default, (x,))
        return [g.call_function(aten.sub.Tensor, (a, b))]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 0
    assert run(gm, torch.zeros(1000))[0].abs().max() > 0


def test_calls_returning_no_tensors_stay_apart():
    # two profiler ranges of one name are two ranges, each entered and exited once
    enter, exit_ = torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit._RecordFunction

    def build(g, x):
        for _ in range(2):
            handle = g.call_function(enter, ("range", None))
            g.call_function(exit_, (handle,))
        return [g.call_function(aten.cos.default, (x,))]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 0
    x = torch.randn(3)
    with torch.profiler.profile() as prof:
        torch.testing.assert_close(run(gm, x)[0], x.cos())
    assert sum(e.name == "range" for e in prof.events()) == 2


def test_graphs_with_in_place_ops_are_left_alone():
    def build(g, x):
        a, b = g.call_function(aten.cos.default, (x,)), g.call_function(aten.cos.default, (x,))
        g.call_function(aten.add_.Tensor, (a, 1.0))  # merged, b would see this write
        return [a, b]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 0
    x = torch.randn(4)
    a, b = run(gm, x)
    torch.testing.assert_close(a - b, torch.ones(4))


def test_returned_nodes_stay_distinct_tensors():
    def build(g, x):
        outs = [g.call_function(aten.sin.default, (x,)) for _ in range(2)]
        views = [g.call_function(aten.t.default, (g.call_function(aten.cos.default, (x,)),)) for _ in range(2)]
        stats = [g.call_function(operator.getitem, (g.call_function(aten.var_mean.correction, (x,)), 1))
                 for _ in range(2)]
        later = g.call_function(aten.sin.default, (x,))  # not returned: merges into the first
        return outs + views + stats + [g.call_function(aten.neg.default, (later,))]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 1
    assert len(calls(gm, aten.sin.default)) == 2
    x = torch.randn(3, 3)
    out = run(gm, x)
    assert len({t.data_ptr() for t in out[:6]}) == 6  # six outputs, six storages, as eager returns
    torch.testing.assert_close(out[6], -x.sin())


def test_literals_of_different_types_do_not_merge():
    def build(g, x):
        adds = [g.call_function(aten.add.Tensor, (x, c)) for c in (1, 1.0, True)]
        muls = [g.call_function(aten.mul.Tensor, (x, c)) for c in (0.0, -0.0)]
        return [g.call_function(aten.cat.default, ([g.call_function(aten.reciprocal.default, (m,)) for m in muls],))] \
            + [g.call_function(aten.cat.default, (adds,))]
    gm = graph_of(build)
    assert eliminate_common_subexpressions(gm.graph) == 0
    x = torch.arange(1, 3)
    inv_zero, added = run(gm, x)
    assert inv_zero.dtype == torch.float32 and inv_zero.tolist() == [float("inf")] * 2 + [float("-inf")] * 2
    assert added.dtype == torch.float32  # add(int, 1.0) promoted; add(int, 1) did not, cat promoted all


class RepeatedWork(nn.Module):
    """GPT-2's pattern: every layer turns the same boolean mask into the same float bias."""

    def __init__(self, layers=3, dim=16):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x, mask):
        for proj in self.proj:
            q = proj(x)
            x = x + F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            x = F.gelu(x) + F.gelu(x)
        return x


def model_inputs():
    x = torch.randn(2, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    return x, mask


def test_model_graph_shrinks_and_weld_matches_eager():
    model = RepeatedWork().eval()
    x, mask = model_inputs()
    gm = torch.fx.symbolic_trace(model)
    aten_gm = to_aten_graph(gm, [x, mask]).gm
    erfs = [n for n in aten_gm.graph.nodes if n.op == "call_function" and n.target is aten.erf.default]
    assert len(erfs) == 3  # one erf per layer, not two
    check(model, [x, mask], atol=1e-5, rtol=1e-5)


def test_training_through_merged_nodes_matches_eager():
    model = RepeatedWork()
    reference = copy.deepcopy(model)
    x, mask = model_inputs()
    gm = torch.fx.symbolic_trace(model)
    state = module_state(gm)
    x_grad = x.clone().requires_grad_()
    joint = trace_joint(gm, state, [s.read(gm) for s in state] + [x_grad, mask])
    erfs = [n for n in joint.gm.graph.nodes if n.op == "call_function" and n.target is aten.erf.default]
    assert len(erfs) == 3  # the forward's erf serves the backward's GELU derivative too

    compiled = torchweld.compile(model, backend="weld")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = compiled(x1, mask), reference(x2, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)


def test_a_graph_with_an_in_place_write_merges_what_does_not_read_the_written_tensor():
    """A decoder step: each layer turns the same boolean mask into the same float bias (merged),
    while reads of the cache on either side of its in-place update stay apart."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    cache, mask, pos, new = (graph.placeholder(n) for n in ("cache", "mask", "pos", "new"))
    bias1 = graph.call_function(aten._to_copy.default, (mask,), {"dtype": torch.float32})
    before = graph.call_function(aten.mul.Tensor, (cache, 2.0))
    view = graph.call_function(aten.view.default, (cache, [8]))
    graph.call_function(aten.index_copy_.default, (cache, 0, pos, new))
    after = graph.call_function(aten.mul.Tensor, (cache, 2.0))
    after_view = graph.call_function(aten.mul.Tensor, (view, 2.0))
    bias2 = graph.call_function(aten._to_copy.default, (mask,), {"dtype": torch.float32})
    graph.output((bias1, before, after, after_view, graph.call_function(aten.add.Tensor, (bias1, bias2))))
    from torchweld.compiler.cse import eliminate_common_subexpressions

    assert eliminate_common_subexpressions(graph) == 1  # bias2 only
    targets = [n.target for n in graph.nodes]
    assert targets.count(aten._to_copy.default) == 1 and targets.count(aten.mul.Tensor) == 3


def test_fresh_tensors_that_are_written_later_stay_apart():
    """Two layers' caches made in the frame (`torch.zeros` twice, then each written by
    index_copy_): merged, both layers' writes would go into one tensor."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    pos, new = graph.placeholder("pos"), graph.placeholder("new")
    first = graph.call_function(aten.zeros.default, ([4, 2],), {"dtype": torch.float32})
    second = graph.call_function(aten.zeros.default, ([4, 2],), {"dtype": torch.float32})
    graph.call_function(aten.index_copy_.default, (first, 0, pos, new))
    graph.output((first, second))
    from torchweld.compiler.cse import eliminate_common_subexpressions

    assert eliminate_common_subexpressions(graph) == 0
