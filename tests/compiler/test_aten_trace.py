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


def _structure(gm):
    """gm's nodes as (op, target, arguments), nodes named by their position, sizes by their text."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg(a):
        return ("node", position[a]) if isinstance(a, torch.fx.Node) else str(a)
    return [(n.op, str(n.target), str(pytree.tree_map(arg, (n.args, n.kwargs)))) for n in gm.graph.nodes]


def _trace_over_symbols(fn, decompositions, shapes):
    """fn traced by an AtenRecorder on fakes of `shapes` whose sizes above 1 are symbols."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tests.test_fake_memo import symbolic_fake
    from torchweld.compiler.aten_trace import AtenRecorder

    recorder = AtenRecorder(decompositions)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    xs = [recorder.placeholder(symbolic_fake(mode, *shape)) for shape in shapes]
    assert recorder._over_symbols
    with mode, recorder:
        out = fn(*xs)
    return recorder.graph_module([out]), mode.shape_env, recorder


@pytest.mark.filterwarnings("ignore:Raw Sym")
def test_a_repeated_decomposition_over_symbols_replays_its_ops(monkeypatch):
    """Over symbols, a decomposed call (and a composite run under the Python dispatcher:
    matmul) with the arguments of one seen before (its sizes' same expressions) records the
    ops that one did, without running the decomposition again: the graph and the guards are
    those of running it each time. A decomposition that reads a tensor literal it made is run
    each time."""
    from torchweld.compiler.aten_trace import AtenRecorder

    aten = torch.ops.aten
    runs = collections.Counter()

    def counted(op, decomposition):
        def run(*args, **kwargs):
            runs[op] += 1
            return decomposition(*args, **kwargs)
        return run

    def gelu_with_a_literal(x, approximate="none"):
        runs[aten.gelu.default] += 1
        return x * torch.tensor(0.5) * (1 + torch.erf(x * 0.7071067811865476))

    table = {**DECOMPOSITIONS, aten.native_layer_norm.default: counted(
        aten.native_layer_norm.default, DECOMPOSITIONS[aten.native_layer_norm.default]),
        aten.gelu.default: gelu_with_a_literal}

    def fn(x, w, m):
        for _ in range(4):
            x = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (16,), w) + 1) @ m
        return x

    from torchweld.compiler.aten_trace import _Recording

    replays = collections.Counter()
    replay = _Recording.replay
    monkeypatch.setattr(_Recording, "replay", lambda self, *a: replays.update([self]) or replay(self, *a))
    # (every size is a symbol; the first calls decide some equal (16), so the next ones have
    # other arguments' expressions, and the last ones the same as those before them)
    replayed, replayed_env, recorder = _trace_over_symbols(fn, table, [(4, 7, 16), (16,), (16, 16)])
    assert runs[aten.native_layer_norm.default] < 4 and runs[aten.gelu.default] == 4
    kinds = {id(recording): key[0] for key, recording in recorder._replays.items() if recording is not None}
    replayed_kinds = {kinds[id(r)] for r in replays}  # (and what they call: var_mean, TensorBase.matmul)
    assert aten.native_layer_norm.default in replayed_kinds
    assert replayed_kinds & {torch.Tensor.__matmul__, torch._C.TensorBase.matmul}
    assert None in recorder._replays.values()  # the gelu that reads its literal
    monkeypatch.setattr(AtenRecorder, "_replayed", lambda self, func, args, kwargs, run: run())
    runs.clear()
    each, each_env, _ = _trace_over_symbols(fn, table, [(4, 7, 16), (16,), (16, 16)])
    assert runs == {aten.native_layer_norm.default: 4, aten.gelu.default: 4}
    assert _structure(replayed) == _structure(each)  # (names aside: a replay's dead ops were numbered too)
    assert [str(g.expr) for g in replayed_env.guards] == [str(g.expr) for g in each_env.guards]


@pytest.mark.filterwarnings("ignore:Raw Sym")
def test_a_replayed_composite_runs_its_ops_under_the_python_dispatcher_as_recorded():
    """F.pad by a symbolic amount runs under the Python dispatcher (constant_pad_nd's C++ meta
    kernel takes ints); its replay, a second pad of the same arguments, runs the recorded ops so
    too (it raised "SymIntArrayRef expected to contain only concrete integers" on the H200,
    where attention's efficient path pads the same way)."""
    def fn(x):
        for _ in range(3):
            x = torch.nn.functional.pad(x, (0, x.shape[-1] // 2))[..., : x.shape[-1]] * 2
        return x

    gm, _, recorder = _trace_over_symbols(fn, DECOMPOSITIONS, [(4, 6)])
    assert any(r is not None for r in recorder._replays.values())
    assert sum(str(n.target) == "aten.constant_pad_nd.default" for n in gm.graph.nodes) == 3
