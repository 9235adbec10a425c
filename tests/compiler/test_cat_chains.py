"""Concatenations that extend an earlier one read it, and one of a tensor and empty 1-d tensors
is that tensor (compiler/cat_chains.py)."""
import pytest
import torch

import torchweld
from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.cat_chains import chain_concatenations, drop_empty_concatenations
from weld_helpers import check

aten = torch.ops.aten


def dense_block(x, w1, w2, w3):
    """A DenseNet block's concatenations: each layer reads all features so far."""
    feats = [x]
    for w in (w1, w2, w3):
        inp = torch.relu(torch.cat(feats, 1) * 0.5)
        feats.append(torch.nn.functional.conv2d(inp, w, padding=1))
    return torch.cat(feats, 1).sigmoid()


def block_inputs():
    return [torch.randn(2, 4, 6, 6), torch.randn(3, 4, 3, 3), torch.randn(3, 7, 3, 3), torch.randn(3, 10, 3, 3)]


def cat_inputs(gm):
    return [[a.name for a in n.args[0]] for n in gm.graph.nodes if n.target is aten.cat.default]


def test_each_concatenation_reads_the_one_before_it():
    aten_graph = to_aten_graph(torch.fx.symbolic_trace(dense_block), block_inputs())
    before = cat_inputs(aten_graph.gm)
    assert [len(c) for c in before] == [1, 2, 3, 4]
    assert chain_concatenations(aten_graph.gm) == 2
    _, first, second, last = [n for n in aten_graph.gm.graph.nodes if n.target is aten.cat.default]
    assert [len(c) for c in cat_inputs(aten_graph.gm)] == [1, 2, 2, 2]
    assert second.args[0][0] is first and last.args[0][0] is second


def test_chained_block_equals_eager_and_its_kernels_read_two_features():
    captured = []
    torchweld.compile(dense_block, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(*block_inputs())
    (gm,) = captured
    assert chain_concatenations(gm) == 2  # on the captured graph, as the weld backend does
    c = check(gm, block_inputs())
    # each layer's kernel reads the previous concatenation and the newest feature, not all of them
    assert max(len(k.reads) for k in c.schedule.kernels()) <= 3


@pytest.mark.parametrize("case", ["dim", "dtype", "order", "axis"])
def test_concatenations_that_do_not_extend_one_are_left(case):
    def fn(a, b, c):
        first = torch.cat([a, b], 1)
        if case == "dim":
            second = torch.cat([a, b, c], 0)
        elif case == "dtype":
            second = torch.cat([a, b, c.double()], 1)
        elif case == "axis":  # numpy's spelling of dim, which the rewrite must not drop
            second = torch.cat([a, b, c], axis=1)
        else:
            second = torch.cat([b, a, c], 1)
        return first * 2, second * 3

    inputs = [torch.randn(3, 3) for _ in range(3)]
    captured = []
    torchweld.compile(fn, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(*inputs)
    (gm,) = captured
    assert chain_concatenations(gm) == 0
    check(gm, inputs)


def test_the_weld_backend_chains_unless_told_not_to():
    from torchweld.backends.weld import prepare

    for option, lengths in ((True, [1, 2, 2, 2]), (False, [1, 2, 3, 4])):
        captured = []
        torchweld.compile(dense_block, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(
            *block_inputs())
        gm = prepare(captured[0], {"chain_concatenations": option, "channels_last": False}, inference=True)
        cats = [n for n in gm.graph.nodes if n.target is torch.cat]
        assert [len(n.args[0]) for n in cats] == lengths
        torchweld.reset()


class CachedAttention(torch.nn.Module):
    """Attention whose keys and values go through a cache that starts as `torch.tensor([])`, as
    transformers' DynamicCache does at its first update (`--case` changes what reads the cache)."""

    def __init__(self, case="attention", dtype=torch.float32):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96).to(dtype)
        self.case = case

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(32, dim=2)
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in (q, k, v))
        k = torch.cat([torch.tensor([], device=x.device), k], dim=-2)  # float32: a bf16 key becomes float32
        v = torch.cat([torch.tensor([], device=x.device), v], dim=-2)
        if self.case == "in_place":  # the graph writes a tensor in place: nothing is read in place
            k.mul_(1.5)
        if self.case == "augmented":  # `k += ...`, an in-place write too
            k += 1.0
        if self.case == "query":  # attention lays its output out by its query's strides
            q, k = k.to(q.dtype), q
        out = torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, 32)
        if self.case == "returned":  # the cache leaves the graph, in eager's layout
            return out, k
        if self.case == "strides":  # a view that needs the concatenation's contiguous layout
            return out, k.view(b, 4 * s * 8)
        return out


def captured_graph(model, *inputs):
    captured = []
    torchweld.compile(model, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(*inputs)
    torchweld.reset()
    return captured[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_concatenated_onto_an_empty_tensor_is_read_in_place(dtype):
    """Both concatenations go (in bf16, the result's float32 is kept: `x.to(float32)`); the
    graph computes what eager does, its outputs and gradients, called with other inputs."""
    torch.manual_seed(0)
    model = CachedAttention(dtype=dtype)
    gm = captured_graph(model, torch.randn(2, 5, 32, dtype=dtype))
    assert drop_empty_concatenations(gm) == 2
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]
    tolerance = 2e-2 if dtype is torch.bfloat16 else 1e-5
    for scale in (1.0, 3.0):
        x = torch.randn(2, 5, 32, dtype=dtype) * scale
        torch.testing.assert_close(gm(x)[0], model(x), atol=tolerance, rtol=tolerance)
        assert gm(x)[0].dtype == model(x).dtype


@pytest.mark.parametrize("case", ["returned", "in_place", "augmented", "strides", "query"])
def test_a_concatenation_something_could_tell_apart_stays(case):
    """The cache returned (its layout is eager's), a tensor written in place in the graph, a
    view that needs the concatenation's contiguous layout, attention's query (whose strides its
    output's follow): each keeps its concatenation."""
    model = CachedAttention(case)
    gm = captured_graph(model, torch.randn(2, 5, 32))
    assert drop_empty_concatenations(gm) == (0 if case in ("in_place", "augmented") else 1)  # (v is read by attention alone)
    x = torch.randn(2, 5, 32)
    expected = model(x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, expected in zip(gm(x), expected):
        torch.testing.assert_close(got, expected)
        assert got.stride() == expected.stride()


def test_weld_trains_through_a_cache_read_in_place():
    """The weld backend with the pass: a training step's gradients equal eager's, called three
    times with other inputs and a weight changed in place between calls."""
    torch.manual_seed(0)
    eager, compiled_model = CachedAttention(), CachedAttention()
    compiled_model.load_state_dict(eager.state_dict())
    step = torchweld.compile(compiled_model, backend="weld")
    for i in range(3):
        if i == 2:
            with torch.no_grad():
                for m in (eager, compiled_model):
                    m.qkv.weight.mul_(-0.5)
        x = torch.randn(2, 5, 32) * (i + 1)
        step(x).square().sum().backward()
        eager(x).square().sum().backward()
        for a, b in zip(compiled_model.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
            a.grad = b.grad = None
