"""Channels-last convolutions (torchweld/passes/channels_last.py): CUDA tensors, and CPU
tensors where aten's convolutions are oneDNN's.

The rewrite is checked on the CPU with fake CUDA example values (what the pass
reads to decide); the rewritten graph is then run on real CPU tensors, where it
must compute what the original does. The CUDA test runs the weld backend on a
real GPU, the CPU test on this machine."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from tests.models import CNN, DenseBlock
from torchweld.passes.channels_last import conv_nodes, to_channels_last


def traced(model: nn.Module, x: torch.Tensor, device: str) -> torch.fx.GraphModule:
    """`model` traced on `x`, with each node's example_value a fake tensor on `device`
    (what the pass reads to decide), as capture leaves them."""
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    with FakeTensorMode():
        for node in gm.graph.nodes:
            meta = node.meta.get("tensor_meta")
            if meta is not None and hasattr(meta, "shape"):
                node.meta["example_value"] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype,
                                                                 device=device)
    return gm


def traced_as_if_on_cuda(model: nn.Module, shape) -> torch.fx.GraphModule:
    return traced(model, torch.randn(shape), "cuda")


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))

    def forward(self, x):
        y = F.conv2d(x, self.w, padding=1)
        return y.relu(), y.sum()


@pytest.mark.parametrize("model,shape,n_convs", [(CNN(), (2, 3, 12, 12), 2), (DenseBlock(), (2, 4, 6, 6), 3),
                                                  (Functional(), (2, 3, 5, 5), 1)])
def test_rewrites_cuda_convs_and_computes_the_same(model, shape, n_convs):
    model.eval()
    gm = traced_as_if_on_cuda(model, shape)
    assert len(conv_nodes(gm)) == n_convs
    for weights in (True, False):  # CUDA convolutions: the input and the weight, either way
        out = to_channels_last(gm, weights=weights)
        assert _channels_last_conversions(out) == 2 * n_convs
    assert not [n for n in out.graph.nodes if n.op == "call_module" and isinstance(out.get_submodule(n.target), nn.Conv2d)]
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(out(x), model(x), atol=1e-4, rtol=1e-4)  # another summation order
    assert gm.graph is not out.graph  # the input graph is not changed
    assert len(conv_nodes(gm)) == n_convs


def test_outputs_keep_eager_layout():
    gm = traced_as_if_on_cuda(Functional(), (2, 3, 5, 5))
    out = to_channels_last(gm)
    last = [n for n in out.graph.nodes if n.target == "contiguous"][-1]
    assert last.kwargs["memory_format"] == torch.contiguous_format and last.users


def _channels_last_conversions(gm: torch.fx.GraphModule) -> int:
    return [n.kwargs.get("memory_format") for n in gm.graph.nodes if n.target == "contiguous"].count(torch.channels_last)


def test_cpu_float32_convs_are_rewritten_where_onednn_runs_them():
    gm = traced(CNN(), torch.randn(2, 3, 12, 12), "cpu")
    assert len(conv_nodes(gm)) == (2 if torch.backends.mkldnn.is_available() else 0)
    if torch.backends.mkldnn.is_available():  # the inputs; the weights too only when asked (else oneDNN's)
        assert _channels_last_conversions(to_channels_last(gm)) == 2
        assert _channels_last_conversions(to_channels_last(gm, weights=True)) == 4


def test_cpu_float64_convs_are_left_alone():  # oneDNN has no float64 convolution: aten's own NCHW one runs
    gm = traced(CNN().double(), torch.randn(2, 3, 12, 12, dtype=torch.float64), "cpu")
    assert to_channels_last(gm) is gm


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("train", [False, True])
def test_weld_runs_cnn_channels_last_on_cpu(train):
    import torchweld
    from torchweld.backends import weld

    graphs = []
    prepare = weld.prepare

    def recording(gm, options, inference):
        graphs.append(prepare(gm, options, inference))
        return graphs[-1]

    model = CNN().train(train)
    reference = CNN().train(train)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 16, 16)
    compiled = torchweld.compile(model, backend="weld")
    with torch.set_grad_enabled(train), pytest.MonkeyPatch.context() as patch:
        patch.setattr(weld, "prepare", recording)
        out, expected = compiled(x), reference(x)
    formats = [n.kwargs.get("memory_format") for gm in graphs for n in gm.graph.nodes if n.target == "contiguous"]
    assert torch.channels_last in formats
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert out.is_contiguous()
    for p, q in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(p, q)  # batch norm's running statistics in training
    if train:
        out.sum().backward()
        expected.sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train", [False, True])
def test_weld_runs_cnn_channels_last_on_cuda(train):
    import torchweld

    model = CNN().cuda().train(train)
    reference = CNN().cuda().train(train)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 16, 16, device="cuda")
    compiled = torchweld.compile(model, backend="weld")
    with torch.set_grad_enabled(train):
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)  # cuDNN may pick other (TF32) kernels
        if train:
            out.sum().backward()
            expected.sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=5e-3, rtol=5e-3)
