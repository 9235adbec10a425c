"""Fusion decisions: how many kernels, what is stored, what is freed."""
import torch

from torchweld.compiler.schedule import Free
from weld_helpers import check


def chain(t):
    for _ in range(2):
        t = torch.sin(t) * 1.5 + 0.5
        t = torch.tanh(t) - torch.exp(-t.abs())
        t = torch.sigmoid(t) * t
    return t


def test_pointwise_chain_is_one_kernel():
    c = check(chain, [torch.randn(1000)])
    kernels = c.schedule.kernels()
    assert len(kernels) == 1
    assert kernels[0].writes == (c.schedule.graph.outputs[0].root,)
    assert not c.externs


def test_softmax_is_one_kernel_with_three_passes():
    c = check(lambda x: torch.softmax(x * 2, -1), [torch.randn(8, 32)])
    (kernel,) = c.schedule.kernels()
    assert kernel.is_reduction and len(kernel.stages) == 3
    assert len(kernel.writes) == 1  # only the output: max and sum stay in registers


def test_layer_norm_gelu_is_one_kernel():
    ln = torch.nn.LayerNorm(16)
    c = check(lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (16,), w, b)),
              [torch.randn(4, 16), ln.weight.detach(), ln.bias.detach()])
    assert len(c.schedule.kernels()) == 1


def test_matmul_is_extern_and_bias_relu_fuse_after_it():
    w, b = torch.randn(8, 16), torch.randn(8)
    c = check(lambda x, w, b: torch.relu(torch.nn.functional.linear(x, w, b)), [torch.randn(4, 16), w, b])
    assert c.externs == ["aten.mm.default"]
    assert len(c.schedule.kernels()) == 1


def test_intermediate_read_by_two_kernels_is_stored_and_freed():
    def fn(x):
        y = x.exp()
        return y.sum(0), y.t().contiguous().sum(0)

    c = check(fn, [torch.randn(6, 5)])
    frees = [s for s in c.schedule.steps if isinstance(s, Free)]
    stored = {w for k in c.schedule.kernels() for w in k.writes}
    outputs = {v.root for v in c.schedule.graph.outputs}
    intermediates = stored - outputs
    assert intermediates  # y feeds two reduction kernels over different dims
    assert intermediates <= {n for f in frees for n in f.names}


def test_buffers_are_reused():
    def fn(x):
        a = (x.exp().sum(1, keepdim=True) + x).sum(0)  # temporaries of one size...
        b = (x.sin().sum(1, keepdim=True) + x).sum(0)  # ...die before the next ones are made
        return a + b

    c = check(fn, [torch.randn(64, 64)])
    assert c.kernel_sources and c.wrapper_source.count("empty_strided") >= 1
