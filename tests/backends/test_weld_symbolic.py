"""weld over symbolic sizes (backends/weld_symbolic.py): one compile serves every size its guards
admit, C++ and Triton (through its interpreter) alike; every call equals eager; a call outside
the guards, and a graph weld cannot compile over symbols, go to the compile per size."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import torchweld
from torchweld.backends.weld_symbolic import CompiledSymbolic

CODEGENS = ["cpp", "triton", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA"))]


def _symbolic(fn) -> CompiledSymbolic:
    fn = getattr(fn, "_compiled_forward", fn)  # a compiled module's
    (entry,) = [e for e in fn.cache_entries if isinstance(e.namespace.get("___graph"), CompiledSymbolic)]
    return entry.namespace["___graph"]


def _compiled(fn, codegen: str, **kwargs):
    options = {} if codegen == "cuda" else {"cpu_codegen": codegen}  # (cuda: Triton, compiled for the GPU)
    return torchweld.compile(fn, backend="weld", dynamic=True, options=options, **kwargs)


def _on(codegen: str, make):
    on_gpu = lambda a: a.cuda() if isinstance(a, torch.Tensor) else a  # noqa: E731 (an int argument stays)
    return (lambda n: tuple(map(on_gpu, make(n)))) if codegen == "cuda" else make


def _run(fn, eager, make, sizes, atol=1e-5):
    for n in sizes:
        args = make(n)
        torch.testing.assert_close(fn(*args), eager(*args), atol=atol, rtol=1e-4)


def _compiled_once(fn) -> None:
    """One compile served every call: none compiled per size, none run as captured."""
    symbolic = _symbolic(fn)
    assert symbolic.per_size.compiles == 0 and symbolic.per_size.calls_as_captured == 0, symbolic.guard.text


def pointwise(x, y):
    return torch.relu(x * 2 + y) - y.sigmoid()


def rows(x):
    return x.sum(-1) * 2, x.amax(-1)


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v) + 1


def masked_attention(q, k, v, mask):
    """GPT-2's form: an additive mask. On CUDA, eager's choice is memory-efficient attention, which
    pads the mask's rows to a multiple of 8 (a pad by a symbolic amount: its C++ meta kernel
    refused symbols until the trace ran attention under the Python dispatcher)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def broadcast_mask_attention(q, k, v, keep):
    """BERT's form: a boolean mask broadcast over the queries. On CUDA, eager's math path, whose
    C++ matmul read the symbols as ints (the length became a number) until the same change."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(-1, -1, q.shape[2], -1))


def scores(q, k):
    return torch.bmm(q, k.transpose(1, 2)) * 0.5


def concatenated(x, y):
    return torch.cat([x, y], 0).t().contiguous() * 2


def columns(x):
    return x.sum(0) + 1, x.mean(0)


def scaled_by_sizes(x):
    """Floats computed from sizes as operands: 0-d tensors the wrapper makes at each call (a
    division's: eager's own kernel, called with the float)."""
    return x * x.shape[0] ** 0.5 + x.shape[1] ** 0.5 - x / x.shape[0] ** 0.5


def counted(x):
    return x + torch.arange(x.shape[0], dtype=x.dtype, device=x.device)


PROGRAMS = {
    "pointwise": (pointwise, lambda n: (torch.randn(n, 7), torch.randn(7))),
    "rows": (rows, lambda n: (torch.randn(3, n),)),
    "attention": (attention, lambda n: tuple(torch.randn(1, 2, n, 8) for _ in range(3))),
    "masked_attention": (masked_attention, lambda n: (*(torch.randn(2, 2, n, 8) for _ in range(3)),
                                                      torch.randn(2, 1, n, n))),
    "broadcast_mask_attention": (broadcast_mask_attention, lambda n: (*(torch.randn(2, 2, n, 8) for _ in range(3)),
                                                                      # (a padding mask: a prefix of each row's keys)
                                                                      torch.arange(n) < torch.randint(1, n + 1, (2, 1, 1, 1)))),
    "scores": (scores, lambda n: (torch.randn(2, n, 8), torch.randn(2, n, 8))),
    "concatenated": (concatenated, lambda n: (torch.randn(n, 4), torch.randn(3, 4))),
    "counted": (counted, lambda n: (torch.randn(n),)),
    "columns": (columns, lambda n: (torch.randn(n, 33),)),
    "scaled_by_sizes": (scaled_by_sizes, lambda n: (torch.randn(n, 3),)),
}


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_one_compile_serves_every_size(name, codegen):
    program, make = PROGRAMS[name]
    fn = _compiled(program, codegen)
    _run(fn, program, _on(codegen, make), (5, 9, 17, 6, 33, 5))
    _compiled_once(fn)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_module_in_inference_over_growing_and_shrinking_batches(codegen):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    model = model.cuda() if codegen == "cuda" else model
    fn = _compiled(model, codegen)
    with torch.no_grad():
        _run(fn, model, _on(codegen, lambda n: (torch.randn(n, 16),)), (4, 9, 3, 30, 2, 9))
    _compiled_once(fn)


def test_intermediates_kept_between_calls_are_not_reused_at_another_size():
    """CPU graphs keep their intermediates for the next call: one of another size is not
    reused (a smaller one was written past its end and corrupted the heap)."""
    def chain(q, k):
        s = torch.bmm(q, k.transpose(1, 2))
        return torch.bmm(s.softmax(-1), k) + q

    fn = _compiled(chain, "cpp")
    _run(fn, chain, lambda n: (torch.randn(2, n, 8), torch.randn(2, n, 8)), (5, 40, 3, 64, 5, 2, 64))


def test_a_call_outside_the_guards_is_compiled_per_size(caplog, monkeypatch):
    """The Triton kernels' code assumed 32-bit indices (a guard; its limit lowered here to 4096
    elements): a larger input is compiled per size, with one log line naming what the compile
    assumed."""
    from torchweld.compiler.codegen import triton

    monkeypatch.setattr(triton, "INT32_LIMIT", 4096)
    monkeypatch.setattr(torchweld.config, "graph_cache", False)  # (an entry from before the patch: loaded)
    fn = _compiled(rows, "triton")
    with torchweld.config.patch(logs="dynamic"), caplog.at_level(logging.INFO, logger="torchweld"):
        _run(fn, rows, lambda n: (torch.randn(3, n),), (5, 9, 2000, 2000, 7))
    symbolic = _symbolic(fn)
    assert "4096" in symbolic.guard.text and symbolic.per_size.compiles == 1
    assert any("a call outside it is compiled per size" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_rows_and_columns_of_any_length_need_no_guard(codegen):
    """Reductions over a symbolic length walk it in chunks (C++) or a loop (Triton) that serve
    every length, short or long, with no assumption to check."""
    def reduced(x):
        return x.sum(-1) * 2, x.amax(-1), x.mean(0), x.softmax(-1)

    fn = _compiled(reduced, codegen)
    long = 5000 if codegen == "cpp" else 600  # (Triton's interpreter: slow)
    _run(fn, reduced, lambda n: (torch.randn(3, n),), (5, 9, 300, long, 7), atol=1e-4)
    _run(fn, reduced, lambda n: (torch.randn(n, 3),), (300, 6, long), atol=1e-4)
    assert _symbolic(fn).guard.always or codegen == "triton"  # (Triton's: 32-bit indices)
    _compiled_once(fn)


def shifted(x, k):
    return x * 2 + k


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_symbolic_int_as_a_value_compiles_over_symbols(codegen):
    """`x * 2 + k`, k an int argument that changes between calls: the kernel takes k as an
    argument (a Triton kernel too, which without it would be size-generic: its code read no
    size but through its mask), one compile serves every k."""
    fn = _compiled(shifted, codegen)
    _run(fn, shifted, _on(codegen, lambda n: (torch.randn(n, 3), n)), (5, 9, 9, 5, 300))
    _compiled_once(fn)


def test_a_graph_weld_cannot_compile_over_symbols_is_compiled_per_size(caplog, monkeypatch):
    """A graph whose kernels weld cannot write over symbols (here: a Triton kernel refused its
    size arguments) is compiled per size, with results as eager's, and the log says why."""
    from torchweld.compiler.codegen import size_args

    monkeypatch.setattr(size_args, "parameterized", lambda kernel: None)
    monkeypatch.setattr(torchweld.config, "graph_cache", False)  # (an entry from before the patch: loaded)
    fn = _compiled(rows, "triton")
    with torchweld.config.patch(logs="dynamic"), caplog.at_level(logging.INFO, logger="torchweld"):
        _run(fn, rows, lambda n: (torch.randn(n, 5),), (5, 9, 9, 5))
    assert not any(isinstance(e.namespace.get("___graph"), CompiledSymbolic) for e in fn.cache_entries)
    assert any("cannot compile it over symbols" in r.getMessage() for r in caplog.records)


def sliced_by_an_int(x, k):
    """An int argument as a value, a slice bound, a branch and a size: `k` changes between calls."""
    y = x * 2 + k
    z = x[:, :k].sum(-1) if k > 2 else x.sum(-1)
    return y, z, torch.arange(k, dtype=x.dtype) * 2


def test_an_int_argument_is_a_symbol_of_the_compile():
    """An int that changes between calls (capture makes it a symbol: a count passed in, a size a
    resume function receives) is one of weld's symbols, read from the argument at each call."""
    fn = _compiled(sliced_by_an_int, "cpp")
    _run(fn, sliced_by_an_int, lambda k: (torch.randn(9, 8), k), (5, 3, 7, 4, 6, 5))
    _compiled_once(fn)


def _train_and_compare(model, fn, make, sizes, atol=1e-5):
    """One step of `fn` (compiled `model`) and of a copy of `model` per size: outputs, input
    gradients, parameter gradients and buffers equal."""
    import copy

    reference = copy.deepcopy(model)
    for n in sizes:
        x = make(n).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        out, expected = fn(x), reference(x2)
        torch.testing.assert_close(out, expected, atol=atol, rtol=1e-4)
        (out * out).sum().backward()
        (expected * expected).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, atol=atol, rtol=1e-4)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-4, msg=lambda m: f"{name} at {n}: {m}")
            p.grad = q.grad = None
        for b, c in zip(model.buffers(), reference.buffers()):  # batch norm's running statistics
            torch.testing.assert_close(b, c, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_training_step_compiles_once_for_every_length(codegen):
    """The joint forward/backward graph over symbols: one compile serves each sequence length,
    its forward and backward kernels taking the length as an argument; gradients equal eager's."""
    from tests.capture.test_dynamic_shapes import Block

    torch.manual_seed(0)
    block = Block()
    block = block.cuda() if codegen == "cuda" else block
    fn = _compiled(block, codegen)
    device = "cuda" if codegen == "cuda" else "cpu"
    lengths = (7, 10, 13, 9, 300, 7) if codegen != "triton" else (7, 10, 13, 7)  # (Triton's interpreter: slow)
    _train_and_compare(block, fn, lambda t: torch.randn(2, t, 16, device=device), lengths, atol=1e-4)
    _compiled_once(fn)


class CausalLayers(torch.nn.Module):
    """Layers alike (GPT-2's form): each one's attention and projection take the same sizes'
    expressions as the layer before's, which a trace over symbols may be tempted to reuse."""

    def __init__(self, layers: int = 3, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))

    def forward(self, x):
        b, t, c = x.shape
        for qkv, out, norm in zip(self.qkv, self.out, self.norm):
            q, k, v = qkv(norm(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(y.transpose(1, 2).reshape(b, t, c))
        return x


@pytest.mark.parametrize("codegen", ["cpp", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_training_step_through_layers_alike_matches_eager_at_every_length(codegen):
    """Automatic dynamic over a stack of causal attention layers: every length's outputs and
    gradients are eager's (a replay of the first layer's attention ops for the next ones,
    tried and dropped, gave GPT-2 wrong gradients over symbols)."""
    torch.manual_seed(0)
    model = CausalLayers()
    model = model.cuda() if codegen == "cuda" else model
    fn = torchweld.compile(model, backend="weld", options={} if codegen == "cuda" else {"cpu_codegen": codegen})
    device = "cuda" if codegen == "cuda" else "cpu"
    _train_and_compare(model, fn, lambda t: torch.randn(2, t, 16, device=device), (9, 13, 17, 9), atol=1e-4)
    _compiled_once(fn)
    model.heads = 4  # an attribute the forward reads: guarded, the step compiled again
    with torch.no_grad():
        model.out[1].weight.mul_(0.5)  # a weight written in place between calls
    _train_and_compare(model, fn, lambda t: torch.randn(2, t, 16, device=device), (11, 9, 15), atol=1e-4)


LITERAL_SCALE = 1.0


def grown_from_a_literal(x):
    """A cache that starts as a literal (`torch.tensor([])`, which capture holds as a constant)
    grown by cat, and split and unbound again: fake_memo replays the cats beside the constant
    and the lists of views. Reads a global, which the test changes between calls."""
    cache = torch.tensor([], device=x.device)
    for k in range(3):
        cache = torch.cat([cache, (x * (k + LITERAL_SCALE)).flatten()])
    parts = cache.view(3, -1).unbind(0)
    a, b = cache.split(cache.shape[0] // 3 * 2)
    return parts[0] + parts[2] * 2, a.sum() - b.sum()


@pytest.mark.parametrize("codegen", ["cpp", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_cache_grown_from_a_literal_matches_eager_at_every_size(codegen):
    """Inference and a training step: every size's outputs and gradients are eager's."""
    device = "cuda" if codegen == "cuda" else "cpu"
    fn = _compiled(grown_from_a_literal, codegen)
    with torch.no_grad():
        _run(fn, grown_from_a_literal, lambda n: (torch.randn(n, 5, device=device),), (4, 7, 9, 4))
    for n in (4, 7, 9, 4):
        x = torch.randn(n, 5, device=device, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, expected = fn(x), grown_from_a_literal(x2)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        (out[0].square().sum() + out[1]).backward()
        (expected[0].square().sum() + expected[1]).backward()
        torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    compiled = [e.namespace["___graph"] for e in fn.cache_entries
                if isinstance(e.namespace.get("___graph"), CompiledSymbolic)]
    assert len(compiled) == 2  # inference and training, each once over symbols
    assert all(c.per_size.compiles == 0 and c.per_size.calls_as_captured == 0 for c in compiled)
    global LITERAL_SCALE
    try:
        for scale in (2.5, 1.0):  # the global changed between calls: each call is eager's
            LITERAL_SCALE = scale
            with torch.no_grad():
                _run(fn, grown_from_a_literal, lambda n: (torch.randn(n, 5, device=device),), (6, 4))
    finally:
        LITERAL_SCALE = 1.0


def test_a_training_graph_over_symbols_reads_the_programs_state_anew():
    """Between calls of one compile over symbols: a weight changed in place, a parameter replaced,
    a module attribute's number and a global changed; each call's output and gradients equal
    eager's (a changed setting or global goes through capture's guards, weights are read per call)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    state = {"scale": 2.0}

    def step(m, x):
        return m(x) * state["scale"]

    fn = _compiled(lambda x: step(model, x), "cpp")
    changes = [
        lambda m: None,
        lambda m: m[0].weight.data.mul_(-0.5),
        lambda m: setattr(m[2], "bias", torch.nn.Parameter(torch.full((4,), 0.25))),
        lambda m: state.update(scale=-1.0),
        lambda m: None,
    ]
    for n, change in zip((5, 9, 3, 12, 7), changes):
        change(model)
        change(reference)
        x = torch.randn(n, 8)
        out, expected = fn(x), step(reference, x)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None


class PositionsFlattened(torch.nn.Module):
    """Position embeddings of `arange(length)`, and a matmul over the flattened (batch * length)
    rows: the backward's saved tensors hold the length alone or in a product with the batch, never
    the batch alone, which the backward still computes with."""

    def __init__(self):
        super().__init__()
        self.positions = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, t, d = x.shape
        h = x + self.positions(torch.arange(t, device=x.device))
        return self.proj(h.reshape(b * t, d)).relu().reshape(b, t, d) * (t ** 0.5)


@pytest.mark.parametrize("codegen", [*CODEGENS, pytest.param("cuda-graphs", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_backward_gets_the_sizes_no_saved_tensor_holds(codegen):
    torch.manual_seed(0)
    model = PositionsFlattened()
    device = "cuda" if codegen.startswith("cuda") else "cpu"
    model = model.to(device)
    # under reduce-overhead each size is a recording of its own, its backward's int inputs too
    fn = _compiled(model, "cuda", mode="reduce-overhead") if codegen == "cuda-graphs" else _compiled(model, codegen)
    sizes = ((2, 5), (3, 9), (2, 12), (4, 7), (3, 9))
    _train_and_compare(model, fn, lambda bt: torch.randn(*bt, 16, device=device), sizes)
    _compiled_once(fn)


def test_a_training_graph_taking_an_int_over_symbols():
    """An int argument that changes between calls is a symbol of the training compile too: an
    input of the forward, and of the backward, which computes with it. Between calls the weight
    changes in place and a setting the step reads changes: each call as eager's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    reference = torch.nn.Linear(16, 16)
    reference.load_state_dict(linear.state_dict())
    state = {"scale": 1.0}

    def step(lin, x, n):
        h = lin(x)[:, :n]
        return (h * n * state["scale"]).reshape(-1, 16).tanh()

    changes = [lambda: None, lambda: [m.weight.data.mul_(-0.5) for m in (linear, reference)],
               lambda: state.update(scale=0.25), lambda: None, lambda: None]
    fn = _compiled(lambda x, n: step(linear, x, n), "cpp")
    for (length, n), change in zip(((5, 3), (7, 4), (9, 6), (6, 2), (8, 5)), changes):
        change()
        x = torch.randn(2, length, 16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, expected = fn(x, n), step(reference, x2, n)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        for p, q in zip(linear.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    # the changed setting is a recompile (capture guards its value), each over symbols, none per size
    compiled = [e.namespace["___graph"] for e in fn.cache_entries if isinstance(e.namespace.get("___graph"), CompiledSymbolic)]
    assert len(compiled) == 2 and all(c.per_size.compiles == c.per_size.calls_as_captured == 0 for c in compiled)


def causal_lm_loss(logits, labels):
    """transformers' causal LM loss: labels padded by one and shifted, cross entropy over the rows."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_a_padded_loss_over_batches_and_lengths_compiles_once(codegen):
    """F.pad of a tensor of symbolic sizes: its C++ kernel read them as ints (the compile went per
    size); under the Python dispatcher it does not."""
    fn = _compiled(causal_lm_loss, codegen)
    for b, t in ((2, 16), (3, 24), (4, 9), (2, 13)):
        logits, labels = torch.randn(b, t, 32), torch.randint(0, 32, (b, t))
        a, b_ = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        torch.testing.assert_close(fn(a, labels), causal_lm_loss(b_, labels))
        fn(a, labels).backward()
        causal_lm_loss(b_, labels).backward()
        torch.testing.assert_close(a.grad, b_.grad)
    _compiled_once(fn)


def test_a_training_graph_with_batch_norm_over_growing_batches():
    """Batch statistics over a symbolic batch, the running statistics written back at each call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    fn = _compiled(model, "cpp")
    _train_and_compare(model, fn, lambda n: torch.randn(n, 8), (4, 9, 33, 6, 4))
    _compiled_once(fn)


def test_the_option_turns_it_off():
    fn = torchweld.compile(pointwise, backend="weld", dynamic=True, options={"symbolic_kernels": False})
    _run(fn, pointwise, PROGRAMS["pointwise"][1], (5, 9))
    assert not any(isinstance(e.namespace.get("___graph"), CompiledSymbolic) for e in fn.cache_entries)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_transformer_block_over_sequence_lengths_compiles_once(codegen):
    """Automatic dynamic: the first length specialized, the second makes the length a symbol,
    and weld compiles that graph once for every later length."""
    from tests.capture.test_dynamic_shapes import Block

    torch.manual_seed(0)
    block = Block().eval()
    block = block.cuda() if codegen == "cuda" else block
    fn = torchweld.compile(block, backend="weld", options={} if codegen == "cuda" else {"cpu_codegen": codegen})
    with torch.no_grad():
        _run(fn, block, _on(codegen, lambda t: (torch.randn(2, t, 16),)), (7, 10, 13, 9, 30, 7))
    _compiled_once(fn)


def written_and_viewed(x, y):
    """An input written in place, a view of an input returned, a size returned as a number."""
    y.add_(1)
    return x.view(-1) * 2, x[1:], y.sum(0), x.shape[0] * 3


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_writes_views_and_sizes_returned_match_eager_at_every_size(codegen):
    fn = _compiled(written_and_viewed, codegen)
    for n in (5, 9, 3, 17, 5):
        x, y = torch.randn(n, 4), torch.randn(n, 6)
        x2, y2 = x.clone(), y.clone()
        got, expected = fn(x, y), written_and_viewed(x2, y2)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(y, y2)  # the write reached the caller's tensor
        assert got[1]._base is x or got[1].data_ptr() == x[1:].data_ptr()  # a view of the input, as eager's
    _compiled_once(fn)


def test_a_module_setting_changed_between_calls_is_read_anew():
    """ln.eps is a number in the kernels compiled over symbols: changed, the call is compiled per size."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(8).eval()
    fn = _compiled(ln, "cpp")
    with torch.no_grad():
        _run(fn, ln, lambda n: (torch.randn(n, 8) * 1e-3,), (5, 9))
        ln.eps = 1e-2
        _run(fn, ln, lambda n: (torch.randn(n, 8) * 1e-3,), (5, 9, 12, 12))


def test_grad_mode_turned_on_after_an_inference_compile():
    """Compiled under no_grad over symbols; called with grad, the capture's guard sends it to a
    training compile (per size), whose gradients equal eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    fn = _compiled(model, "cpp")
    with torch.no_grad():
        _run(fn, model, lambda n: (torch.randn(n, 8),), (4, 6))
    for n in (4, 7):
        x = torch.randn(n, 8)
        model.zero_grad()
        fn(x).sum().backward()
        grad = model[0].weight.grad.clone()
        model.zero_grad()
        model(x).sum().backward()
        torch.testing.assert_close(grad, model[0].weight.grad)


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_batch_norm_statistics_in_training_mode_under_no_grad(codegen):
    """Found by the fuzzer (seed 127): a float computed from a size (the unbiased variance's
    n / (n - 1)) reached an extern call as the compile's SymFloat object itself, and the running
    statistics came out NaN. The wrapper computes it from the bound symbols at each call."""
    torch.manual_seed(0)
    compiled_bn, eager_bn = torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4)
    eager_bn.load_state_dict(compiled_bn.state_dict())
    fn = _compiled(lambda x: compiled_bn(x) * 2, codegen)
    with torch.no_grad():
        for n in (3, 5, 9, 3):
            x = torch.randn(n, 4)
            torch.testing.assert_close(fn(x), eager_bn(x) * 2)
            torch.testing.assert_close(compiled_bn.running_mean, eager_bn.running_mean)
            torch.testing.assert_close(compiled_bn.running_var, eager_bn.running_var)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_a_compile_over_symbols_is_kept_in_the_graph_cache_and_still_serves_every_size(codegen, tmp_path):
    """With the graph cache on (users' default; the suite runs with it off), the compile over
    symbols is stored and serves every size: on CUDA its store failed (a fast launch's SymInt
    grid in the entry's JSON) and the graph went per size."""
    import glob
    import os

    with torchweld.config.patch(cache_dir=str(tmp_path), graph_cache=True):
        fn = _compiled(pointwise, codegen)
        _run(fn, pointwise, _on(codegen, lambda n: (torch.randn(n, 8), torch.randn(n, 8))), (5, 9, 13, 7))
    _compiled_once(fn)
    assert glob.glob(os.path.join(str(tmp_path), "graphs", "*.json"))
