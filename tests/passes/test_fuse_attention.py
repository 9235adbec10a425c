"""Attention written out by hand becomes one scaled_dot_product_attention call
(torchweld/passes/fuse_attention.py): the forms it rewrites, the ones it must leave,
and the weld backend's result against eager."""
import logging
import math

import pytest
import torch
import torch.nn.functional as F

import torchweld
from tests.models import Block
from torchweld.passes.fuse_attention import fuse_attention


ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])


def captured(fn, *inputs):
    """(graph, its example inputs) for each graph capture hands a backend for fn(*inputs),
    the graph after fuse_attention."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((fuse_attention(gm), list(example_inputs)))
        return gm.forward

    with torch.no_grad():
        torchweld.compile(fn, backend=backend)(*inputs)
    return graphs


def fused_count(gm) -> int:
    return sum(n.op == "call_function" and n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)


def check_rewritten(fn, *inputs):
    [(gm, example_inputs)] = captured(fn, *inputs)
    assert fused_count(gm) == 1, gm.code
    with torch.no_grad():
        [got] = gm(*example_inputs)
        torch.testing.assert_close(got, fn(*inputs), atol=1e-5, rtol=1e-5)
    return gm


def qkv(b=2, h=3, length=10, source=12, e=8):
    return torch.randn(b, h, length, e), torch.randn(b, h, source, e), torch.randn(b, h, source, e)


def test_the_forms_of_scale_are_rewritten():
    q, k, v = qkv()
    forms = [
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v,
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v,
        lambda q, k, v: torch.matmul(F.softmax(0.3 * torch.matmul(q, k.transpose(2, 3)), -1), v),
        lambda q, k, v: (q @ torch.transpose(k, 3, 2)).softmax(dim=3) @ v,  # no scale: 1
    ]
    for fn in forms:
        check_rewritten(fn, q, k, v)


def test_an_additive_mask_becomes_attn_mask():
    q, k, v = qkv(length=12)
    causal = torch.full((12, 12), float("-inf")).triu(1)
    padding = torch.zeros(2, 1, 1, 12)
    padding[1, ..., 9:] = float("-inf")
    for mask in (causal, padding):
        gm = check_rewritten(lambda q, k, v, m: torch.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v,
                             q, k, v, mask)
        [node] = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        assert node.kwargs["attn_mask"] is not None


class CausalSelfAttention(torch.nn.Module):
    """minGPT's attention: a causal mask filled with -inf, dropout on the probabilities."""

    def __init__(self, d=32, heads=4, length=16):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.attn_dropout = torch.nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(length, length)).view(1, 1, length, length))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return (att @ v).transpose(1, 2).reshape(b, t, d)


@ON_DEVICES
def test_a_causal_mask_filled_with_minus_inf_and_eval_dropout(device):
    torch.manual_seed(0)
    model = CausalSelfAttention().eval().to(device)
    x = torch.randn(2, 12, 32, device=device)
    [(gm, example_inputs)] = captured(model, x)
    assert fused_count(gm) == 1, gm.code
    assert not any(n.op == "call_module" and "dropout" in str(n.target) for n in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(gm(*example_inputs)[0], model(x), atol=1e-5, rtol=1e-5)
        compiled = torchweld.compile(model, backend="weld")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    # F.dropout(training=False) is an identity too
    q, k, v = (t.to(device) for t in qkv())
    check_rewritten(lambda q, k, v: F.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.5, training=False) @ v,
                    q, k, v)


def test_dropout_that_drops_keeps_the_attention():
    model = CausalSelfAttention().train()  # its dropout is live: the masks must stay eager's
    [(gm, _)] = captured(model, torch.randn(2, 12, 32))
    assert fused_count(gm) == 0


def test_what_is_not_attention_stays():
    q, k, v = qkv()
    kept = [
        # the probabilities are returned too
        lambda q, k, v: (lambda p: (p @ v, p))(torch.softmax(q @ k.transpose(-2, -1), dim=-1)),
        # softmax over another dim
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v,
        # a tensor scale
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * v.mean(), dim=-1) @ v,
        # softmax in another dtype
        lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float64).float() @ v,
    ]
    for fn in kept:
        [(gm, _)] = captured(fn, q, k, v)
        assert fused_count(gm) == 0, gm.code
    # k handed in transposed already: no transpose node to take k from
    [(gm, _)] = captured(lambda q, kt, v: torch.softmax(q @ kt, dim=-1) @ v, q, k.transpose(-2, -1).contiguous(), v)
    assert fused_count(gm) == 0
    # a float64 attention: its scores would not go through aten's fused kernels the same way
    q64, k64, v64 = (t.double() for t in (q, k, v))
    [(gm, _)] = captured(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v, q64, k64, v64)
    assert fused_count(gm) == 0


@ON_DEVICES
def test_weld_runs_a_transformer_block_through_one_attention_call(caplog, device):
    torch.manual_seed(0)
    model = Block(d=64, heads=4).eval().to(device)
    x = torch.randn(3, 16, 64, device=device)
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"), torch.no_grad():
        compiled = torchweld.compile(model, backend="weld")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        x2 = torch.randn(2, 24, 64, device=device)  # a new shape: the guards fail, the rewrite happens again
        for _ in range(2):  # weld compiles a symbolic graph's size at its second call
            torch.testing.assert_close(compiled(x2), model(x2), atol=1e-5, rtol=1e-5)
    externs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extern call")]
    assert sum("scaled_dot_product" in line for line in externs) == 2, externs
    assert not any("bmm" in line for line in externs), externs


@ON_DEVICES
def test_training_runs_one_attention_call_each_way(caplog, device):
    """With gradients too: the joint graph differentiates scaled_dot_product_attention, so
    the forward runs aten's fused attention and the backward its fused backward (flash
    attention's on the CPU), with no (L, S) probabilities saved in between."""
    torch.manual_seed(0)
    model = Block(d=32, heads=4).to(device)
    x = torch.randn(2, 8, 32, device=device, requires_grad=True)
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"):
        compiled = torchweld.compile(model, backend="weld")
        compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    model(x).sum().backward()
    expected = [p.grad for p in model.parameters()] + [x.grad]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    externs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extern call")]
    attention = [line for line in externs if "scaled_dot_product" in line or "attention" in line]
    # one line per compile of a graph: on CUDA the backward may compile twice (ahead, for the
    # joint trace's layouts, and again for the tangents' layouts at the first backward)
    forward = [line for line in attention if "backward" not in line]
    assert len(forward) == 1 and len(attention) > len(forward), externs
    assert not any("bmm" in line for line in externs), externs

