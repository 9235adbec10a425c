"""Attention recorded as one opaque op in inference traces over symbolic sizes
(torchweld/runtime/opaque_attention.py, where tuning.opaque_attention_over_symbols asks; on
CUDA only, here let through on the CPU): the op's result and layout, and BERT and a causal
grouped-query block compiled over lengths against eager, the op in the graph over symbols."""
import logging

import pytest
import torch
import torch.nn.functional as F

import torchweld
from torchweld.runtime import opaque_attention
from torchweld.tuning import tuning


@pytest.fixture
def opaque(monkeypatch):
    monkeypatch.setattr(tuning, "opaque_attention_over_symbols", True)
    monkeypatch.setattr(opaque_attention, "on_attention_device", lambda t: True)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_the_op_is_sdpa_laid_out_position_major(mask):
    q, k, v = (torch.randn(2, 4, 7, 8) for _ in range(3))
    m = {"bool": torch.rand(2, 1, 7, 7) > 0.3, "float": torch.randn(1, 1, 1, 7), None: None}[mask]
    out = opaque_attention.attention(q, k, v, m, False, 0.3, False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3))
    assert out.stride() == (7 * 4 * 8, 8, 4 * 8, 1)
    assert out.transpose(1, 2).reshape(2, 7, 32).data_ptr() == out.data_ptr()  # a view


def test_what_it_leaves_to_atens_trace(monkeypatch):
    q = torch.randn(1, 2, 3, 4)
    assert opaque_attention.bind((q, q, q), {"dropout_p": 0.0, "is_causal": True}) is not None
    assert opaque_attention.bind((q, q, q), {"bogus": 1}) is None
    assert not opaque_attention.applies((q, q, q), {})  # the CPU
    monkeypatch.setattr(opaque_attention, "on_attention_device", lambda t: True)
    assert opaque_attention.applies((q, q, q), {"is_causal": True, "scale": 0.5})
    assert not opaque_attention.applies((q, q, q), {"dropout_p": 0.1})
    assert not opaque_attention.applies((q, q, q), {"scale": torch.tensor(0.5)})
    assert not opaque_attention.applies((q[0], q[0], q[0]), {})  # 3-d
    grad_q = q.clone().requires_grad_()
    assert not opaque_attention.applies((grad_q, q, q), {})  # training: aten's differentiable path
    with torch.no_grad():
        assert opaque_attention.applies((grad_q, q, q), {})


def test_bert_over_lengths_equals_eager_with_the_op_in_the_symbolic_graph(opaque, caplog):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_hidden_layers=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    compiled = torchweld.compile(model, backend="weld")
    query = model.encoder.layer[0].attention.self.query
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"), torch.no_grad():
        for n in (12, 20, 33, 7, 20):
            ids = torch.randint(0, 500, (2, n))
            mask = torch.ones(2, n, dtype=torch.long)
            mask[1, n // 2:] = 0  # a padded row: the mask is broadcast over heads
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got, model(input_ids=ids, attention_mask=mask).last_hidden_state)
            query.weight.mul_(1.1)  # the attention's inputs change between calls
    assert "extern call: torchweld.attention.default" in caplog.text


def test_a_causal_grouped_block_over_lengths_equals_eager(opaque, caplog):
    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2)

    compiled = torchweld.compile(block, backend="weld", dynamic=True)
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"):
        for n in (9, 17, 30):
            q, k, v = torch.randn(2, 8, n, 16), torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)
            torch.testing.assert_close(compiled(q, k, v), block(q, k, v))
    assert "extern call: torchweld.attention.default" in caplog.text


def test_training_keeps_atens_decomposition(opaque, caplog):
    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).square().mean()

    compiled = torchweld.compile(loss, backend="weld", dynamic=True)
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"):
        for n in (9, 17):
            q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for _ in range(3))
            compiled(q, k, v).backward()
            grads = [t.grad for t in (q, k, v)]
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            loss(q2, k2, v2).backward()
            for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
                torch.testing.assert_close(got, want)
    assert "torchweld.attention" not in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bert_on_cuda_over_lengths_equals_eager(monkeypatch, caplog, dtype):
    """On CUDA, where the op replaces the math path's decomposition of BERT's masked attention."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(tuning, "opaque_attention_over_symbols", True)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_hidden_layers=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval().cuda().to(dtype)
    compiled = torchweld.compile(model, backend="weld")
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"), torch.no_grad():
        for n in (12, 20, 33, 7, 20):
            ids = torch.randint(0, 500, (2, n), device="cuda")
            mask = torch.ones(2, n, dtype=torch.long, device="cuda")
            mask[1, n // 2:] = 0
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got, model(input_ids=ids, attention_mask=mask).last_hidden_state, **tol)
    assert "extern call: torchweld.attention.default" in caplog.text
