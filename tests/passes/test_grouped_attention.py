"""Decoding attention over repeated key/value heads runs over the unrepeated heads
(torchweld/passes/grouped_attention.py): the forms rewritten (gpt-fast's repeat_interleave,
transformers' repeat_kv), the ones left alone, and weld's results against eager over calls
that move the decoding position."""
import pytest
import torch
import torch.nn.functional as F

import torchweld
from torchweld.passes.grouped_attention import group_query_heads

ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])


def repeat_kv(t, r):  # transformers' form
    b, kv, s, d = t.shape
    return t[:, :, None, :, :].expand(b, kv, r, s, d).reshape(b, kv * r, s, d)


def gpt_fast(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                                          attn_mask=mask)


def transformers_style(q, k, v, mask):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.3)


def written_out(q, k, v, mask):  # eager attention, which fuse_attention makes one call first
    scores = q @ repeat_kv(k, 4).transpose(-2, -1) * 0.125 + mask
    return torch.softmax(scores, dim=-1) @ repeat_kv(v, 4)


def rewritten(fn, *inputs) -> int:
    """How many attentions of fn's graph group_query_heads rewrote."""
    counts = []

    def backend(gm, example_inputs):
        from torchweld.passes.fuse_attention import fuse_attention

        group_query_heads(fuse_attention(gm))
        counts.append(sum("attention" in str(n.target) and n.args[0].target == "reshape" for n in gm.graph.nodes))
        assert not any(n.target == "repeat_interleave" for n in gm.graph.nodes) or not counts[-1]
        return gm.forward

    with torch.no_grad():
        torchweld.compile(fn, backend=backend)(*inputs)
    return sum(counts)


def inputs(device, length=1, mask_dtype=torch.bool, s=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, 8, length, 16, generator=g, dtype=dtype).to(device)
    k, v = (torch.randn(2, 2, s, 16, generator=g, dtype=dtype).to(device) for _ in range(2))
    mask = torch.rand(1, 1, length, s, generator=g) > 0.3
    mask[..., 0] = True
    if mask_dtype is not torch.bool:
        mask = torch.zeros(mask.shape, dtype=mask_dtype).masked_fill(~mask, float("-inf"))
    return q, k, v, mask.to(device)


@pytest.mark.parametrize("fn, mask_dtype", [(gpt_fast, torch.bool), (transformers_style, torch.bool),
                                            (transformers_style, torch.float32), (written_out, torch.float32)])
def test_decoding_attention_over_repeated_heads_is_rewritten(fn, mask_dtype):
    assert rewritten(fn, *inputs("cpu", mask_dtype=mask_dtype)) == 1


def test_attention_over_several_query_positions_is_left_alone():
    assert rewritten(gpt_fast, *inputs("cpu", length=3)) == 0


def test_attention_whose_repeated_heads_are_read_elsewhere_is_left_alone():
    def fn(q, k, v, mask):
        k = k.repeat_interleave(4, dim=1)
        return F.scaled_dot_product_attention(q, k, v.repeat_interleave(4, dim=1), attn_mask=mask), k.sum()

    assert rewritten(fn, *inputs("cpu")) == 0


def test_causal_or_dropout_attention_is_left_alone():
    def causal(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)

    assert rewritten(causal, *inputs("cpu")) == 0


@ON_DEVICES
@pytest.mark.parametrize("fn", [gpt_fast, transformers_style, written_out])
def test_weld_matches_eager(fn, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    compiled = torchweld.compile(fn, backend="weld")
    for mask_dtype in (torch.bool, torch.float32) if fn is not written_out else (torch.float32,):
        q, k, v, mask = inputs(device, mask_dtype=mask_dtype, dtype=dtype)
        if mask.dtype != torch.bool:
            mask = mask.to(dtype)
        with torch.no_grad():
            tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
            torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask), **tol)


class Decoder(torch.nn.Module):
    """A KV cache written at a position per call, read through repeated heads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 32, 8))
        self.register_buffer("v", torch.zeros(1, 2, 32, 8))
        self.register_buffer("causal", torch.tril(torch.ones(32, 32, dtype=torch.bool)))
        self.proj = torch.nn.Linear(8, 8 * 5)

    def forward(self, x, pos):
        q, k, v = self.proj(x).split([24, 8, 8], dim=-1)  # 3 query heads of 8, one key/value head
        q = q.view(1, 1, 3, 8).transpose(1, 2)
        self.k.index_copy_(2, pos, k.view(1, 1, 1, 8).expand(1, 1, 2, 8).transpose(1, 2).contiguous())
        self.v.index_copy_(2, pos, v.view(1, 1, 1, 8).expand(1, 1, 2, 8).transpose(1, 2).contiguous())
        keys = self.k[:, :1].repeat_interleave(3, dim=1)
        values = self.v[:, :1].repeat_interleave(3, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.causal[None, None, pos])
        return out.transpose(1, 2).reshape(1, 1, 24)


def test_a_decoding_loop_matches_eager_at_every_position():
    torch.manual_seed(0)
    model, reference = Decoder(), Decoder()
    reference.load_state_dict(model.state_dict())
    compiled = torchweld.compile(model, backend="weld")
    with torch.no_grad():
        for p in [0, 1, 2, 5, 3, 30]:
            x = torch.randn(1, 1, 8)
            torch.testing.assert_close(compiled(x, torch.tensor([p])), reference(x, torch.tensor([p])))
            torch.testing.assert_close(model.k, reference.k)


def _decode_inputs(device, dtype, mask_kind, b=2, kv=2, r=3, d=16, s=150):
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype) for shape in
               ((b, kv, r, d), (b, kv, s, d), (b, kv, s, d)))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, 1, s, generator=g) > 0.3
        mask[..., 0] = True
        mask = mask.to(device).expand(b, kv, r, s)
    elif mask_kind == "float":
        mask = torch.randn(1, 1, r, s, generator=g).to(device, dtype)
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_decode_attention_kernel_in_tritons_interpreter(mask_kind, monkeypatch):
    """The split kernel's numbers against aten's attention, on the CPU through Triton's
    interpreter (float16: the interpreter has no bfloat16), with 4 splits of a cache whose
    length is no multiple of the split or the block."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the kernel runs on CUDA (test_decode_attention_kernel_on_cuda)")
    from torchweld.runtime import decode_attention as da

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(da, "splits_for", lambda groups, length, device: 4)
    da._kernels.cache_clear()
    try:
        q, k, v, mask = _decode_inputs("cpu", torch.float16, mask_kind)
        out = da.decode_attention(q, k, v, mask, 0.25)
    finally:
        da._kernels.cache_clear()
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.25,
                                               attn_mask=None if mask is None else mask if mask.dtype == torch.bool
                                               else mask.float())
    torch.testing.assert_close(out.float(), reference, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_decode_attention_kernel_on_cuda(mask_kind):
    from torchweld.runtime.decode_attention import decode_attention

    for s in (150, 2048):
        q, k, v, mask = _decode_inputs("cuda", torch.bfloat16, mask_kind, d=64, s=s)
        as_float = None if mask is None else mask if mask.dtype == torch.bool else mask.float()
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125, attn_mask=as_float)
        torch.testing.assert_close(decode_attention(q, k, v, mask, 0.125).float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weld_decoding_on_cuda_uses_the_split_kernel():
    from torchweld.compiler.pipeline import run_fx_passes

    graphs = []

    def capture_only(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v, mask = inputs("cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torchweld.compile(gpt_fast, backend=capture_only)(q, k, v, mask)
    rewritten = run_fx_passes(graphs[0], {}, inference=True)
    assert any(n.target is torch.ops.torchweld.decode_attention.default for n in rewritten.graph.nodes)
    compiled = torchweld.compile(gpt_fast, backend="weld")
    with torch.no_grad():
        for p in range(3):  # new values each call, the same graph
            q, k, v, mask = (t.roll(p, -2) for t in (q, k, v, mask))
            torch.testing.assert_close(compiled(q, k, v, mask), gpt_fast(q, k, v, mask), atol=2e-2, rtol=2e-2)


def test_value_heads_of_another_size_are_left_alone():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                                              attn_mask=mask)

    q, k, _, mask = inputs("cpu")
    v = torch.randn(2, 2, 16, 8)
    assert rewritten(fn, q, k, v, mask) == 0
    torch.testing.assert_close(torchweld.compile(fn, backend="weld")(q, k, v, mask), fn(q, k, v, mask))


def test_transformers_llama_with_a_static_cache_decodes_as_eager():
    """transformers' Llama generating with its StaticCache (made lazily, in the first compiled
    call; written by index_copy_; read through repeat_kv): one graph, each token's logits
    as eager's, the caches too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ours, theirs = (transformers.StaticCache(config=config, max_cache_len=64) for _ in range(2))

    def step(model, ids, pos, cache):
        return model(input_ids=ids, position_ids=pos[None], cache_position=pos, past_key_values=cache,
                     use_cache=True).logits

    graphs = []

    def counting(gm, example_inputs):
        from torchweld.backends import lookup_backend

        graphs.append(gm)
        return lookup_backend("weld")(gm, example_inputs)

    compiled = torchweld.compile(step, backend=counting)
    with torch.no_grad():
        for p in range(5):
            ids, pos = torch.tensor([[p + 3]]), torch.tensor([p])
            torch.testing.assert_close(compiled(model, ids, pos, ours), step(model, ids, pos, theirs))
    for a, b in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert len(graphs) == 2  # the first call makes the caches; from the second on they exist
