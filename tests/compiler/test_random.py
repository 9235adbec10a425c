"""Random numbers drawn inside the kernels (Op.RAND): dropout's mask without an aten call.

Triton kernels on CUDA tensors where there is a GPU, else on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before
triton is imported); C++ kernels draw the same numbers from the same seeds."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweld
from torch.fx.experimental.proxy_tensor import make_fx
from torchweld.autograd import module_state, partition, trace_joint
from torchweld.runtime.seeded_rand import seeded_rand
from weld_helpers import weld_compile

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRITON = {} if CUDA else {"cpu_codegen": "triton"}


@pytest.fixture(autouse=True)
def triton_runs():
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or Triton's interpreter")


def dropout(x):
    return F.dropout(x, 0.3, training=True) * 2 + 1


def test_dropout_draws_in_the_kernel_and_keeps_its_fraction():
    x = torch.randn(64, 300, device=DEVICE)
    compiled = weld_compile(dropout, [x], TRITON)
    assert not any("bernoulli" in e or "rand_like" in e for e in compiled.externs), compiled.externs
    assert any("randint" in e and "seeds of 1 random op" in e for e in compiled.externs)
    out = compiled(x)
    kept = out != 1
    assert 0.66 < kept.float().mean() < 0.74
    # kept elements are x / (1 - p), the others 0, as eager's dropout
    torch.testing.assert_close(out[kept], (x / 0.7 * 2 + 1)[kept])


def test_seeded_runs_repeat_and_unseeded_runs_differ():
    x = torch.randn(32, 50, device=DEVICE)
    compiled = weld_compile(dropout, [x], TRITON)
    torch.manual_seed(1)
    a = compiled(x)
    torch.manual_seed(1)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_two_random_ops_of_one_graph_draw_different_numbers():
    x = torch.randn(40, 40, device=DEVICE)
    compiled = weld_compile(lambda x: [torch.rand_like(x), torch.rand_like(x)], [x], TRITON)
    first, second = compiled(x)
    assert not torch.equal(first, second)
    for r in (first, second):
        assert r.min() >= 0 and r.max() < 1
        assert 0.45 < r.mean() < 0.55


def test_layers_that_differ_only_in_their_seed_share_one_kernel_source():
    """Each random op reads its seed through a view of its own (one aten.unbind of the seeds
    drawn), not at an offset written into the source: GPT-2's dropout + residual + layer
    norm kernels, one per layer, are one source; each layer still draws its own mask."""
    def layers(x, w, r):
        dropped = []
        for _ in range(3):
            h = F.dropout(x @ w, 0.5, training=True)
            dropped.append(h == 0)
            x = F.layer_norm(h + r, (64,))
        return x, dropped

    x, r = torch.randn(16, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE)
    w = torch.eye(64, device=DEVICE)
    compiled = weld_compile(layers, [x, w, r], TRITON)
    source = compiled.kernel_sources["triton"]
    # the mask drawn over each row, and once a row at its first element (layer norm's
    # variance is summed about that element: rules.var)
    assert source.count("@triton.jit") == 1 and source.count("tl.rand(") == 2, source
    _, (first, second, third) = compiled(x, w, r)
    assert not torch.equal(first, second) and not torch.equal(second, third)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_stay_below_one(dtype):
    x = torch.zeros(256, 256, dtype=dtype, device=DEVICE)
    compiled = weld_compile(lambda x: torch.rand_like(x) * 1, [x], TRITON)
    r = compiled(x)
    assert r.dtype == dtype and r.min() >= 0 and r.max() < 1


def test_a_view_of_random_numbers_reads_the_same_numbers():
    """Two readers of one rand_like through different views compute the same counters."""
    x = torch.randn(16, 24, device=DEVICE)
    compiled = weld_compile(lambda x: (lambda r: [r, r.t() + 0, r[::2] * 1])(torch.rand_like(x)), [x], TRITON)
    r, t, every_other = compiled(x)
    assert torch.equal(t, r.t())
    assert torch.equal(every_other, r[::2])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on CPU tensors need its interpreter")
def test_cpp_kernels_draw_the_numbers_triton_draws():
    x = torch.randn(64, 30)
    cpp = weld_compile(dropout, [x])
    triton_on_cpu = weld_compile(dropout, [x], {"cpu_codegen": "triton"})
    assert not any("bernoulli" in e for e in cpp.externs), cpp.externs
    torch.manual_seed(5)
    a = cpp(x)
    torch.manual_seed(5)
    assert torch.equal(a, triton_on_cpu(x))


def test_float64_random_numbers_come_from_aten():
    """Kernels draw 32 random bits; a float64 rand keeps aten's 53."""
    x = torch.randn(8, 8, dtype=torch.float64)
    compiled = weld_compile(lambda x: torch.rand_like(x) + x, [x])
    assert any("rand_like" in e for e in compiled.externs) and not any("randint" in e for e in compiled.externs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_seeded_rand_draws_the_numbers_the_kernels_draw(dtype, codegen):
    """runtime/seeded_rand.py's aten implementation and weld's kernels give the same bits for
    a seed: a training step may draw dropout's mask in a kernel and draw it again in a graph
    that runs eagerly (a lowering refused), or the other way round."""
    if codegen == "cpp" and CUDA:
        pytest.skip("C++ kernels are for CPU tensors")
    if codegen == "triton" and not CUDA and dtype is torch.bfloat16:
        pytest.skip("Triton's interpreter truncates float32 to bfloat16; the GPU rounds to nearest, as aten does")
    seeds = [0, 1, -1, 2**63 - 1, -2**63, 123456789012345]
    seed = torch.tensor(0, device=DEVICE)
    graph = make_fx(lambda s: seeded_rand(s, [7, 300], dtype))(seed)
    compiled = weld_compile(graph, [seed], {} if codegen == "cpp" else TRITON)
    assert not compiled.externs, compiled.externs
    for value in seeds:
        seed = torch.tensor(value, device=DEVICE)
        expected = seeded_rand(seed, [7, 300], dtype)
        assert expected.min() >= 0 and expected.max() < 1
        assert torch.equal(compiled(seed), expected), value
    assert 0.45 < expected.float().mean() < 0.55


def test_a_backward_run_eagerly_draws_the_mask_the_forward_kernel_drew():
    """The forward compiled by weld draws dropout's mask in its kernel from a seed it
    returns; the backward, here run as aten ops, draws the same mask from that seed."""
    def fn(x):
        return F.dropout(x.sin(), 0.4, training=True) * 3

    x = torch.randn(24, 40, device=DEVICE, requires_grad=True)
    gm = torch.fx.symbolic_trace(fn)
    joint = trace_joint(gm, module_state(gm), [x])
    part = partition(joint, "min_cut")
    forward = weld_compile(part.forward, [x.detach()], TRITON)
    out, *intermediates = forward(x.detach())
    saved = [x.detach() if kind == "primal" else intermediates[i] for kind, i in part.saved]
    assert any(t.dtype == torch.int64 and t.dim() == 0 for t in saved)
    (grad,) = part.backward(*saved, torch.ones_like(out))
    kept = out != 0
    assert 0.5 < kept.float().mean() < 0.7
    torch.testing.assert_close(grad, kept.float() / 0.6 * 3 * x.detach().cos())


def test_training_mask_of_forward_and_backward_agree():
    """The forward kernel draws the mask from a seed; the backward draws it again from that
    seed, saved in place of the mask."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 48), nn.Dropout(0.4), nn.Tanh()).to(DEVICE)
    x = torch.randn(20, 48, device=DEVICE, requires_grad=True)
    compiled = torchweld.compile(model, options=TRITON)
    out = compiled(x)
    out.sum().backward()
    pre = model[0](x).detach()
    kept = out.detach() != 0
    assert 0.5 < kept.float().mean() < 0.7
    torch.testing.assert_close(out.detach()[kept], torch.tanh(pre / 0.6)[kept])
    # d out / d x = W^T (mask / (1 - p) * tanh'): eager's formula with the compiled mask
    grad_pre = kept.float() / 0.6 * (1 - out.detach() ** 2)
    torch.testing.assert_close(x.grad, grad_pre @ model[0].weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_draw_new_masks():
    x = torch.randn(128, 256, device="cuda")
    compiled = torchweld.compile(dropout, mode="reduce-overhead")
    outs = [compiled(x).clone() for _ in range(4)]
    assert all(not torch.equal(a, b) for a, b in zip(outs, outs[1:]))
    for out in outs:
        assert 0.66 < (out != 1).float().mean() < 0.74
    torch.manual_seed(3)
    first = compiled(x).clone()
    torch.manual_seed(3)
    assert torch.equal(compiled(x), first)


@pytest.mark.skipif(not CUDA, reason="kernels launch through compiled launchers on CUDA alone")
def test_a_backward_reading_saved_seeds_launches_no_kernel_through_the_jit(monkeypatch):
    """The seeds the backward reads are 0-d views 8 bytes apart in one buffer: half of them
    are not 16-byte aligned. The compiled kernels assume no alignment for 0-d inputs, so no
    call takes the JIT path (Triton's launcher in Python, inputs held to the end)."""
    import triton

    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.2), nn.GELU(), nn.Linear(64, 64), nn.Dropout(0.2),
                          nn.Tanh(), nn.Dropout(0.2)).cuda()
    x = torch.randn(32, 64, device="cuda")
    compiled = torchweld.compile(model)
    compiled(x).sum().backward()
    launches = []
    run = triton.runtime.jit.JITFunction.run
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", lambda self, *a, **k: (launches.append(self),
                                                                                       run(self, *a, **k))[1])
    out = compiled(x)
    out.sum().backward()
    torch.cuda.synchronize()
    assert not launches, launches
    kept = out.detach() != 0
    assert 0.55 < kept.float().mean() < 0.73  # two dropouts of 0.2 before the output: 0.8 ** 2 kept


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_training_replays_draw_new_masks_and_their_backward_draws_them_again():
    """Under reduce-overhead the forward replay lends its saved seeds to the backward replay,
    which draws each step's mask again from them: new masks every step, gradients that
    follow each step's own mask."""
    lin = nn.Linear(64, 64).cuda()
    compiled = torchweld.compile(lambda x: F.dropout(lin(x), 0.5, training=True), mode="reduce-overhead")
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    masks = []
    for _ in range(4):
        x.grad = None
        out = compiled(x)
        out.backward(torch.ones_like(out))
        kept = out.detach() != 0
        masks.append(kept.clone())
        assert 0.4 < kept.float().mean() < 0.6
        torch.testing.assert_close(x.grad, (kept.float() * 2) @ lin.weight.detach())
    assert all(not torch.equal(a, b) for a, b in zip(masks, masks[1:]))
