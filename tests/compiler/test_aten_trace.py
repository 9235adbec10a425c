"""AtenRecorder (compiler/aten_trace.py) against torch's make_fx: the same aten ops for
real models, tensor literals copied, placeholders ahead of every op."""
import collections

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tests.models import CNN, MLP, Block, DenseBlock
from torchweld.compiler.aten_graph import DECOMPOSITIONS, to_aten_graph


def _make_fx_graph(gm, inputs):
    def flat(*args):
        return pytree.tree_leaves(gm(*args))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(x) for x in inputs]
    with torch.no_grad(), mode:
        traced = make_fx(flat, decomposition_table=DECOMPOSITIONS, tracing_mode="real")(*fake)
    traced.graph.eliminate_dead_code()
    return traced


def _ops(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("make,shape", [(MLP, (8, 16)), (CNN, (2, 3, 12, 12)), (Block, (2, 8, 32)),
                                        (DenseBlock, (2, 4, 8, 8))])
def test_same_ops_as_make_fx_and_runs_like_eager(make, shape):
    model = make().eval()
    x = torch.randn(shape)
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        ours = to_aten_graph(gm, [x])
        assert _ops(ours.gm) == _ops(_make_fx_graph(gm, [x]))
        out = pytree.tree_unflatten(list(ours.gm(x)), ours.out_spec)
        torch.testing.assert_close(out, model(x))
    assert all("val" in n.meta for n in ours.gm.graph.nodes if n.op != "output")


def test_tensor_literal_written_in_place_is_a_copy():
    import torchweld

    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    def fn(x):
        t = torch.tensor([1.0, 2.0])
        t.add_(x)
        return t * 2

    x = torch.randn(2)
    with torch.no_grad():
        torchweld.compile(fn, backend=keep)(x)
        ours = to_aten_graph(*graphs[0])
    assert torch.ops.aten.lift_fresh_copy.default in [n.target for n in ours.gm.graph.nodes]
    for _ in range(2):  # the literal itself is not changed by a run
        torch.testing.assert_close(ours.gm(x)[0], fn(x))
    torch.testing.assert_close(torchweld.compile(fn)(x), fn(x))


def test_placeholders_added_late_stay_first():
    from torchweld.compiler.aten_trace import AtenRecorder

    recorder = AtenRecorder({})
    with FakeTensorMode() as mode:
        a = recorder.placeholder(mode.from_tensor(torch.randn(3)))
        with recorder:
            b = a.sin()
        t = recorder.placeholder(torch.empty(3))  # like a tangent, added after the forward's ops
        with recorder:
            c = b * t
    gm = recorder.graph_module([c])
    ops = [n.op for n in gm.graph.nodes]
    assert ops[:2] == ["placeholder", "placeholder"] and ops.count("placeholder") == 2
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y)[0], x.sin() * y)
