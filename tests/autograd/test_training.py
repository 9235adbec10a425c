"""Training through the weld backend: outputs, gradients, buffers and optimizer
steps equal eager's, on the CPU (GPU variants where CUDA is there)."""
import copy
import logging
import gc
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchweld
from torchweld.autograd import CompiledTrainingGraph, DoubleBackwardError, compile_training
from torchweld.backends import lookup_backend

from tests.models import CNN, MLP, Block, DenseBlock

TOL = dict(atol=1e-4, rtol=1e-4)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MODELS = [(MLP, (8, 16)), (CNN, (2, 3, 12, 12)), (Block, (2, 8, 32)), (DenseBlock, (2, 4, 8, 8))]


def assert_same_training_state(model, reference, skip_buffers=()):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}.grad: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        if not any(s in name for s in skip_buffers):
            torch.testing.assert_close(b, c, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,shape", MODELS, ids=[m.__name__ for m, _ in MODELS])
def test_gradients_match_eager(make, shape, device, request):
    if device == "cuda":  # weld runs convolutions channels-last: other cuDNN kernels, equal only without TF32
        flags = torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
        flags.__enter__()
        request.addfinalizer(lambda: flags.__exit__(None, None, None))
    model = make().to(device)
    reference = copy.deepcopy(model)
    compiled = torchweld.compile(model, backend="weld")
    for step in range(2):  # the second call reuses the compiled graphs
        x = torch.randn(shape, device=device, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, expected = compiled(x), reference(x_ref)
        assert "CompiledGraphFunctionBackward" in repr(out)
        torch.testing.assert_close(out, expected, **TOL)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
        assert_same_training_state(model, reference)


@pytest.mark.parametrize("make,shape", [(CNN, (2, 3, 12, 12)), (DenseBlock, (2, 4, 8, 8))], ids=["CNN", "DenseBlock"])
def test_channels_last_training_is_compiled(make, shape):
    """Channels-last activations (what weld uses for CUDA convolutions) make the joint
    graph write views in place (`as_strided(zeros).copy_(...)` in a pooling backward,
    an in-place ReLU after batch norm): functionalization must still compile it."""
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torchweld.compile(model, backend="weld")(x)
    assert "CompiledGraphFunctionBackward" in repr(out)
    expected = reference(x)
    torch.testing.assert_close(out, expected, **TOL)
    out.sum().backward()
    expected.sum().backward()
    assert_same_training_state(model, reference)


def test_batch_norm_running_stats_through_the_backend():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    fn = lookup_backend("weld")(torch.fx.symbolic_trace(model), [x])
    assert isinstance(fn.current, CompiledTrainingGraph)  # behind the check of the modules' settings
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8)
        fn(x).sum().backward()
        reference(x).sum().backward()
    assert_same_training_state(model, reference)
    assert model[1].num_batches_tracked.item() == 3


@pytest.mark.parametrize("make,shape", [(MLP, (8, 16)), (CNN, (4, 3, 8, 8)), (Block, (2, 8, 32))],
                         ids=["MLP", "CNN", "Block"])
def test_five_adam_steps_match_eager(make, shape):
    model = make()
    reference = copy.deepcopy(model)
    compiled = torchweld.compile(model, backend="weld")
    # Some gradients here are zero up to rounding (a conv bias before train-mode batch
    # norm, the key bias under softmax); Adam with its default eps=1e-8 blows rounding
    # noise (~1e-9) up to lr-sized steps, so eps is raised far above that noise.
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-4)
    for _ in range(5):
        x = torch.randn(shape)
        for m, o in ((compiled, opt), (reference, opt_ref)):
            o.zero_grad(True)
            m(x).square().mean().backward()
            o.step()
    assert_same_training_state(model, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("make,shape", [(CNN, (4, 3, 8, 8)), (Block, (2, 8, 32)), (DenseBlock, (2, 4, 8, 8))],
                         ids=["CNN", "Block", "DenseBlock"])
def test_reduce_overhead_training_matches_eager_on_cuda(make, shape, request):
    """mode="reduce-overhead": forward and backward replay as CUDA graphs, step after step."""
    flags = torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
    flags.__enter__()
    request.addfinalizer(lambda: flags.__exit__(None, None, None))
    model = make().cuda()
    reference = copy.deepcopy(model)
    from torchweld.runtime.cudagraphs import CudaGraphPool, CudaGraphRecorder

    pool = CudaGraphPool(CudaGraphRecorder())
    compiled = torchweld.compile(model, backend="weld", mode="reduce-overhead", options={"cudagraph_pool": pool})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-4)
    for _ in range(5):
        x = torch.randn(shape, device="cuda")
        losses = []
        for m, o in ((compiled, opt), (reference, opt_ref)):
            o.zero_grad(True)
            loss = m(x).square().mean()
            loss.backward()
            o.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], **TOL)
    assert_same_training_state(model, reference)
    assert 2 <= pool.graphs_recorded <= 3  # forward and backward (one more while a loss is held)


# The tutorial's train step, compiled as a whole (globals, as in the tutorial: capture
# breaks graphs only in functions without closures). The test sets the globals: an
# optimizer made at import would import triton before test_triton sets TRITON_INTERPRET.
tutorial_model = tutorial_opt = None


def tutorial_train(x, y):
    tutorial_opt.zero_grad(True)
    pred = tutorial_model(x)
    loss = nn.CrossEntropyLoss()(pred, y)
    loss.backward()
    tutorial_opt.step()
    return loss


def _tutorial_steps_match_eager(train, device: str = "cpu", check=lambda loss: None) -> None:
    """Five steps of `train` (the tutorial's step over the globals) beside eager's on a copy of
    the model and optimizer: each loss, then the parameters and optimizer state, equal."""
    reference = copy.deepcopy(tutorial_model)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opt_ref.load_state_dict(tutorial_opt.state_dict())
    for _ in range(5):
        x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
        loss = train(x, y)
        opt_ref.zero_grad(True)
        expected = nn.CrossEntropyLoss()(reference(x), y)
        expected.backward()
        opt_ref.step()
        torch.testing.assert_close(loss, expected, **TOL)
        check(loss)
    assert_same_training_state(tutorial_model, reference)


def test_tutorial_train_step():
    global tutorial_model, tutorial_opt
    tutorial_model = MLP()
    tutorial_opt = torch.optim.Adam(tutorial_model.parameters(), lr=1e-2)

    def check(loss):
        assert "CompiledGraphFunctionBackward" in repr(loss)

    _tutorial_steps_match_eager(torchweld.compile(tutorial_train), check=check)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_whole_step_under_reduce_overhead_matches_eager_on_cuda():
    """The tutorial's step compiled whole under reduce-overhead: forward, backward and Adam's
    graph replay as CUDA graphs; Adam's reads the gradients where the backward's replay left
    them (no copy into static buffers), and parameters track eager's step after step."""
    global tutorial_model, tutorial_opt
    from torchweld.runtime.cudagraphs import CudaGraphed, CudaGraphPool, CudaGraphRecorder

    tutorial_model = MLP().cuda()
    tutorial_opt = torch.optim.Adam(tutorial_model.parameters(), lr=1e-2)
    pool = CudaGraphPool(CudaGraphRecorder())
    train = torchweld.compile(tutorial_train, mode="reduce-overhead", options={"cudagraph_pool": pool})
    _tutorial_steps_match_eager(train, device="cuda")
    graphed = [o for o in gc.get_objects() if type(o) is CudaGraphed and o.pool is pool]  # no isinstance: a dead
    # weakref proxy among the objects raises ReferenceError when asked its class
    optimizer = [g for g in graphed if g.adopted]
    assert optimizer and len(optimizer[0].adopted) >= len(list(tutorial_model.parameters()))


def compile_fn(fn, *inputs):
    return lookup_backend("weld")(torch.fx.symbolic_trace(fn), list(inputs))


def test_a_model_called_under_autocast_trains_like_eager():
    """The usual mixed-precision step: the compiled model called inside torch.autocast, the
    backward outside it. weld traces forward and backward with autocast's casts; gradients
    come back float32, equal to eager's within bfloat16's precision."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    eager, model = make(), make()
    compiled = torchweld.compile(model, backend="weld")
    for m in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
            assert out.dtype == torch.bfloat16
            assert ("CompiledGraphFunction" in type(out.grad_fn).__name__) == (m is compiled)
            loss = nn.functional.cross_entropy(out, y)
        loss.backward()
    for p, q in zip(eager.parameters(), model.parameters()):
        assert q.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, atol=5e-3, rtol=5e-2)


def _rotate_half(x, w):
    """Llama's rotate_half: the halves of the last dim swapped, one negated (a slice each)."""
    x = x * w
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1) * 3 + x[:, 1:].sum(1, keepdim=True)


def test_the_backward_of_slices_is_a_kernel_not_extern_fills_and_copies(caplog):
    """slice_backward (zeros and slice_scatter, an extern fill and an extern copy in aten's
    decomposition) is a pad of the gradient: fused into the backward's kernels."""
    x, w = torch.randn(4, 6, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    compiled = torchweld.compile(_rotate_half, backend="weld")
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"):
        for _ in range(2):
            got = torch.autograd.grad(compiled(x, w).square().sum(), (x, w))
            want = torch.autograd.grad(_rotate_half(x, w).square().sum(), (x, w))
            for g, e in zip(got, want):
                torch.testing.assert_close(g, e)
    externs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extern call")]
    assert not any("slice" in line or "pad" in line for line in externs), externs


class _RotaryStyle(nn.Module):
    """Llama's rotary embedding: a float32 matmul in a `torch.autocast(enabled=False)` region,
    between autocast's bfloat16 linears."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.freqs = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        h = self.inp(x)
        with torch.autocast("cpu", enabled=False):
            angles = h.float() @ self.freqs.float()
            h = h.float() * angles.cos() + angles.sin()
        return self.out(h)


@pytest.mark.parametrize("codegen", [True, False], ids=["kernels", "aten ops"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_float32_region_under_autocast_runs_its_traced_casts_only(training, codegen):
    """The graph of a float32 region inside autocast holds a float32 matmul; run under the
    user's autocast again, that extern call came back bfloat16, half the bytes the next kernel
    read (a segfault in GPT-2's training step, where the CPU's attention math keeps float32).
    Compiled graphs run with autocast off (runtime/autocast_off.py), and so do the traced aten
    graphs a training step runs as they are (training_codegen=False); every call equals eager."""
    torch.manual_seed(0)
    eager = _RotaryStyle()
    model = copy.deepcopy(eager)
    compiled = torchweld.compile(model, backend="weld", options=None if codegen else {"training_codegen": False})
    for step in range(3):
        x = torch.randn(4, 8, 16)
        for m in (eager, compiled):
            m.zero_grad()
            with torch.set_grad_enabled(training), torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            if training:
                out.float().square().mean().backward()
            if m is eager:
                expected = out
        assert out.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)
        if training:
            for p, q in zip(eager.parameters(), model.parameters()):
                torch.testing.assert_close(q.grad, p.grad, atol=3e-2, rtol=5e-2)


def test_mixed_outputs_and_inputs():
    """Inputs without grad, outputs without grad, an output aliasing an input, a None gradient."""
    def fn(x, w, unused, frozen):
        y = (x * w).sin()
        return y, frozen.view(-1), (x > 0).sum(), x.detach() * 2

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    unused, frozen = torch.randn(2, requires_grad=True), torch.randn(2, 2)
    compiled = compile_fn(fn, x, w, unused, frozen)
    y, view, count, detached = compiled(x, w, unused, frozen)
    ey, eview, ecount, edetached = fn(x, w, unused, frozen)
    for a, b in ((y, ey), (view, eview), (count, ecount), (detached, edetached)):
        torch.testing.assert_close(a, b)
    assert y.requires_grad and not count.requires_grad and not detached.requires_grad
    assert view.data_ptr() == frozen.data_ptr()
    y.sum().backward()
    gx, gw = torch.autograd.grad(ey.sum(), [x, w])
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)
    assert unused.grad is None


def test_detached_views_of_inputs_do_not_require_grad():
    """weld makes `t.view(-1).detach()` a view of `t`; eager's does not require grad, and
    neither may ours (an autograd.Function's output that views an input kept requiring it)."""
    fns = [lambda t, w: (t * w, t.view(-1).detach()), lambda t, w: (t.detach(), w[0].detach() + t),
           lambda t, w: t.view(-1).detach()]
    t, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    for fn in fns:
        got, expected = torchweld.compile(fn, backend="weld")(t, w), fn(t, w)
        got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
            assert (a.requires_grad, a.grad_fn is None) == (b.requires_grad, b.grad_fn is None)


def test_whole_step_returns_a_detached_loss():
    """The tutorial's step returning `loss.detach()`: eager's has no grad_fn; the graph after
    the break at `loss.backward()` made it a view of `loss`, which kept `loss`'s."""
    model = MLP()
    opt = torch.optim.Adam(model.parameters())

    def step(x, y):
        opt.zero_grad(True)
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    compiled = torchweld.compile(step, backend="weld")
    for _ in range(3):
        loss = compiled(torch.randn(8, 16), torch.randint(0, 4, (8,)))
        assert not loss.requires_grad and loss.grad_fn is None


def test_output_that_is_an_input_passes_gradients():
    def fn(x, w):
        return x, x * w

    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    a, b = compile_fn(fn, x, w)(x, w)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, 1 + w)
    torch.testing.assert_close(w.grad, x.detach())


def test_mutated_user_input_is_written_back():
    def fn(x, counter):
        counter.add_(1)
        return x.exp() * counter

    x, counter = torch.randn(4, requires_grad=True), torch.zeros(4)
    compiled = compile_fn(fn, x, counter.clone())
    out = compiled(x, counter)
    torch.testing.assert_close(counter, torch.ones(4))
    out.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().exp())


class MaskedEmbedding(torch.nn.Module):
    """wav2vec2's SpecAugment: a mask from numpy (a graph break), then `hidden[mask] = embed`
    in place on the output of the graph before it, with a parameter that must get its gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.embed = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        hidden = self.lin(x).transpose(0, 1).transpose(0, 1)  # a view of the graph's intermediate
        mask = torch.tensor(np.arange(hidden.shape[0]) % 2 == 0)
        hidden[mask] = self.embed
        return (hidden * 2).sum()


def test_an_in_place_change_to_a_graph_output_keeps_its_gradients():
    model = MaskedEmbedding()
    x = torch.randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchweld.compile(model)(x).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, msg=name)


def test_outputs_that_view_an_intermediate_can_be_changed_in_place():
    def fn(x, w):
        h = x @ w
        return h.t(), h.sum(0)  # a view of the matmul's result, beside another output

    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    rows, total = compile_fn(fn, x, w)(x, w)
    rows[0] = 0.0  # autograd forbade this on a custom Function's view outputs
    (rows.sum() + total.sum()).backward()
    ours, w.grad = w.grad, None
    eager_rows, eager_total = fn(x, w)
    eager_rows[0] = 0.0
    (eager_rows.sum() + eager_total.sum()).backward()
    torch.testing.assert_close(rows, eager_rows)
    torch.testing.assert_close(ours, w.grad)


def test_outputs_that_view_an_input_stay_views_of_it():
    def fn(x, w):
        return x.view(-1), (x * w).sum()

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    flat, total = compile_fn(fn, x, w)(x, w)
    assert flat._base is x  # as eager's: not detached with the views of intermediates
    (flat.sum() * 2 + total).backward()
    ours, x.grad, w.grad = x.grad, None, None
    eager_flat, eager_total = fn(x, w)
    (eager_flat.sum() * 2 + eager_total).backward()
    torch.testing.assert_close(ours, x.grad)


def test_dropout_forward_and_backward_use_the_same_mask():
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    x = torch.randn(32, 64)
    compiled = torchweld.compile(model, backend="weld")
    out = compiled(x)
    out.backward(torch.ones_like(out))
    pre = model[0](x)
    dropped = out == 0
    assert 0.3 < dropped.float().mean() < 0.7
    # d out / d pre is 2 where kept and 0 where dropped: the bias gradient counts the kept ones twice.
    kept_twice = 2 * (~dropped & (pre != 0)).float().sum(0)
    torch.testing.assert_close(model[0].bias.grad, kept_twice)


def test_channel_dropout_masks_whole_channels_in_forward_and_backward():
    """Dropout2d draws one number per (sample, channel); the backward draws them again from
    the forward's seed: each step's bias gradient counts exactly the kept channels' elements."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3)
    compiled = torchweld.compile(nn.Sequential(conv, nn.Dropout2d(0.5)), backend="weld")
    masks = []
    for _ in range(3):
        conv.zero_grad()
        x = torch.randn(4, 3, 8, 8)
        out = compiled(x)
        out.sum().backward()
        kept = (out != 0).float().amax((2, 3), keepdim=True)
        masks.append(kept)
        with torch.no_grad():
            torch.testing.assert_close(out, conv(x) * 2 * kept)
        torch.testing.assert_close(conv.bias.grad, 2 * 36 * kept.sum((0, 2, 3)))
    assert not torch.equal(masks[0], masks[1])


def test_double_backward_is_a_clear_error():
    x = torch.randn(4, requires_grad=True)
    compiled = compile_fn(lambda x: (x * x).sin(), x)
    out = compiled(x).sum()
    with pytest.raises(DoubleBackwardError, match="create_graph"):
        torch.autograd.grad(out, x, create_graph=True)


def test_backward_with_retain_graph_runs_twice():
    """The compiled backward frees saved activations as it goes, but not under retain_graph:
    a second backward through the same graph adds the same gradients as eager's, and a third,
    after one without retain_graph, raises eager's error."""
    model = CNN()
    reference = copy.deepcopy(model)
    compiled = torchweld.compile(model, backend="weld")
    x = torch.randn(2, 3, 12, 12)
    out, expected = compiled(x).square().sum(), reference(x).square().sum()
    for retain in (True, False):
        out.backward(retain_graph=retain)
        expected.backward(retain_graph=retain)
        assert_same_training_state(model, reference)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def test_a_backward_run_as_aten_ops_takes_its_inputs_in_the_list_too():
    """options={"training_codegen": False}: the partitioned graphs run their aten ops eagerly,
    a backward that takes its inputs positionally; gradients still equal eager's."""
    model = CNN()
    reference = copy.deepcopy(model)
    compiled = torchweld.compile(model, backend="weld", options={"training_codegen": False})
    x = torch.randn(2, 3, 12, 12)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert_same_training_state(model, reference)


def test_save_all_and_min_cut_agree():
    model = Block()
    x = torch.randn(2, 8, 32, requires_grad=True)
    gm = torch.fx.symbolic_trace(model)
    grads, saved_all_bytes = {}, None
    for strategy in ("save_all", "min_cut"):
        compiled = compile_training(gm, [x], strategy=strategy)
        model.zero_grad()
        x.grad = None
        compiled(x).square().sum().backward()
        grads[strategy] = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        if strategy == "min_cut":
            assert compiled.partition.saved_bytes < saved_all_bytes
        saved_all_bytes = compiled.partition.saved_bytes
    for a, b in zip(grads["save_all"], grads["min_cut"]):
        torch.testing.assert_close(a, b, **TOL)


W = torch.randn(4, 3, requires_grad=True)


def _view_write_intermediate(x, buf):
    y = x @ W
    y[0].mul_(2)
    return y


def _view_write_input(x, buf):
    buf[0].add_(1)
    buf[1:].mul_(x.detach().sum())
    return (x @ W * buf).sum(), buf


def _view_write_chain(x, buf):
    y = x @ W
    y[:, 1].add_(buf[0, 0])
    y[0][1:].mul_(3)
    return y.sum() + y[1].sum(), y


def _view_write_stale_views(x, buf):
    v, t = buf[:, 1], buf.t()
    buf[0].add_(1)
    t[1].mul_(3)
    buf.add_(v.unsqueeze(0).clone())
    return (x @ W * buf).sum() + (t * v).sum(), t, v


def _view_write_split(x, buf):
    a, b = buf.split([1, 2], 0)
    b.mul_(3)
    h = (x @ W).t()
    h[0].copy_(buf[0])
    return (x @ W * buf).sum() + h.sum() * 2


@pytest.mark.parametrize("fn", [_view_write_intermediate, _view_write_input, _view_write_chain,
                                _view_write_stale_views, _view_write_split], ids=lambda f: f.__name__[12:])
def test_writes_through_views_are_compiled_for_training(fn):
    """In-place writes through views of inputs and intermediates (`y[0].mul_(2)`, `buf.t()[1].mul_(3)`,
    a view taken before the write and read after) compile: outputs, written inputs and gradients
    as eager's on every call. They ran eagerly ("in-place aten.mul_.Tensor on a view (select) is
    not supported"); one input a view at an offset of a larger tensor."""
    compiled = None
    for call in range(3):
        results = []
        for run in ("compiled", "eager"):
            W.grad = None
            g = torch.Generator().manual_seed(call)
            x = torch.randn(3, 4, generator=g).requires_grad_()
            buf = torch.randn(4, 3, generator=g)[1:] if call == 2 else torch.randn(3, 3, generator=g)
            if run == "compiled" and compiled is None:
                compiled = compile_fn(fn, x, buf)
                assert isinstance(compiled, CompiledTrainingGraph)
            out = (compiled if run == "compiled" else fn)(x, buf)
            outs = out if isinstance(out, tuple) else (out,)
            sum(o.sum() for o in outs if o.requires_grad).backward()
            results.append((out, buf, x.grad, W.grad, [o is buf for o in outs], [o._is_view() for o in outs]))
        torch.testing.assert_close(*results)


def test_graph_that_cannot_be_functionalized_runs_eagerly():
    """An as_strided write into an input laid out with gaps: no copy of it keeps its strides."""
    def fn(x, buf):
        buf.as_strided((2,), (1,), buf.storage_offset() + 1).add_(1)
        return (x * buf).sum()

    x = torch.randn(2, 3, requires_grad=True)
    with warnings.catch_warnings():
        compiled = compile_fn(fn, x, torch.randn(4, 3)[::2])
    assert not isinstance(compiled, CompiledTrainingGraph)
    big = torch.randn(4, 3)
    expected = big.clone()
    expected[0, 1:3] += 1
    compiled(x, big[::2]).backward()
    torch.testing.assert_close((big, x.grad), (expected, expected[::2]))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_come_out_in_their_parameters_layout(device):
    """autograd copies a gradient whose strides differ from its parameter's (outside size-1
    dims) before it keeps it; the compiled backward writes it in the parameter's layout."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)  # channels-last activations give channels-last weight gradients
            self.weight = nn.Parameter(torch.randn(4, 8).t())  # strides (1, 8)

        def forward(self, x):
            return self.conv(x).mean((2, 3)) @ self.weight

    model = Model().to(device)
    reference = copy.deepcopy(model)
    seen = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: seen.update({name: g.stride()}))
    x = torch.randn(2, 3, 10, 10, device=device).to(memory_format=torch.channels_last)
    torchweld.compile(model, backend="weld")(x).sum().backward()
    reference(x).sum().backward()
    assert_same_training_state(model, reference)
    for name, p in model.named_parameters():
        assert all(n == 1 or a == b for n, a, b in zip(p.shape, seen[name], p.stride())), (name, seen[name], p.stride())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="channels-last convolutions are for CUDA tensors")
def test_channels_last_weights_are_converted_once_per_step_in_the_graph():
    """cuDNN converts a 3x3 weight that is not channels-last itself, with an aten clone,
    in the forward and again in the backward; compiled training converts it in the graph."""
    from torch.profiler import ProfilerActivity, profile

    model = CNN().cuda()
    compiled = torchweld.compile(model, backend="weld")
    x = torch.randn(2, 3, 12, 12, device="cuda")
    for _ in range(2):
        compiled(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        compiled(x).sum().backward()
    clones = [e.input_shapes for e in prof.events() if e.name == "aten::clone"]
    assert not [shapes for shapes in clones if shapes and len(shapes[0]) == 4], clones  # (the tangent of .sum() is one)


def test_batch_norm_step_counters_are_one_kernel():
    """Each batch norm in training adds 1 to its step counter: single elements, updated by one
    kernel for all, though convolutions (extern calls) lie between them."""
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))])
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    compiled = compile_training(torch.fx.symbolic_trace(model), [x])
    for _ in range(2):
        compiled(x).sum().backward()
        reference(x).sum().backward()
    assert_same_training_state(model, reference)
    schedule = compiled.graph.forward.schedule
    counters = [k for k in schedule.kernels() if any(schedule.layouts[w][1].shape == () for w in k.writes)]
    assert len(counters) == 1 and len(counters[0].writes) == 3


FIRST_CUDA_WORK = """
import torch, torchweld
from tests.models import CNN
model = CNN().cuda()
opt = torch.optim.Adam(model.parameters())
def train(x):
    opt.zero_grad(True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss
step = torchweld.compile(train)
for _ in range(3):
    step(torch.randn(4, 3, 8, 8, device="cuda"))
torch.cuda.synchronize()
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_backward_launches_on_a_fresh_autograd_thread():
    """The backward runs on autograd's device thread. In a fresh process its first launch
    is weld's own (the C launcher), on a thread where no CUDA context was made current yet:
    the launcher makes it current, as Triton's launchers do (it failed with CUDA error 201)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", FIRST_CUDA_WORK], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("make,shape", MODELS, ids=[m.__name__ for m, _ in MODELS])
def test_backward_is_compiled_ahead_for_the_layouts_it_gets(make, shape, monkeypatch):
    """The backward compiles in a thread, for the input layouts the joint trace gives it, from
    when the forward's kernels are with the compilers (on the CPU, once the forward is
    compiled); the first backward uses it: those are the layouts it gets."""
    import threading

    from torchweld.autograd import training

    compiles = []
    original = training.compile_aten

    def spy(gm, example_inputs, options, what, *rest, **kwargs):
        compiles.append((what, threading.current_thread().name))
        return original(gm, example_inputs, options, what, *rest, **kwargs)

    monkeypatch.setattr(training, "compile_aten", spy)
    monkeypatch.setattr(torchweld.config, "graph_cache", False)  # (a loaded step compiles nothing ahead)
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(shape)
    torchweld.compile(model, backend="weld")(x).sum().backward()
    reference(x).sum().backward()
    assert_same_training_state(model, reference)
    backward = [thread for what, thread in compiles if what == "backward"]
    assert len(backward) == 1 and backward[0].startswith("torchweld-backward"), compiles
    assert compiles[0][0] == "forward"


def test_backward_compiled_for_other_layouts_is_compiled_again():
    from concurrent.futures import Future

    from torchweld.autograd.training import _result_if_layouts_match

    ahead = Future()
    ahead.set_result("compiled ahead")
    assumed = [torch.empty(4, 6), torch.empty(2, 3)]
    assert _result_if_layouts_match(ahead, assumed, [torch.empty(4, 6), torch.empty(2, 3)]) == "compiled ahead"
    assert _result_if_layouts_match(ahead, assumed, [torch.empty(6, 4).t(), torch.empty(2, 3)]) is None
    assert _result_if_layouts_match(ahead, assumed, [torch.empty(4, 6), torch.empty(2, 3).double()]) is None
    failed = Future()
    failed.set_exception(RuntimeError("no"))
    assert _result_if_layouts_match(failed, assumed, assumed) is None
    assert _result_if_layouts_match(None, assumed, assumed) is None


def test_backward_compiled_ahead_takes_inputs_on_another_device_that_only_externs_read():
    """CUDA's efficient attention keeps its dropout's Philox seed and offset in CPU tensors
    that its fake kernel puts on the GPU: the backward compiled ahead passes them to the
    attention backward only, and serves (GPT-2 and BERT compiled their backward twice)."""
    from concurrent.futures import Future

    from torchweld.autograd.training import _result_if_layouts_match

    class Compiled:
        def __init__(self, read):
            self.read = read

        def inputs_read_by_kernels(self):
            return self.read

    assumed = [torch.empty(4, 6), torch.empty((), dtype=torch.int64, device="meta")]
    example = [torch.empty(4, 6), torch.empty((), dtype=torch.int64)]
    for read, served in (({0}, True), ({0, 1}, False)):
        ahead = Future()
        ahead.set_result(Compiled(read))
        assert (_result_if_layouts_match(ahead, assumed, example) is not None) is served


def test_state_reader_sees_replaced_state():
    """Module state is read afresh at each call, from the dict that holds it: a parameter
    or buffer replaced on its module is seen; one deleted and set again as a plain
    attribute (it leaves `_parameters`) is read by getattr."""
    from torchweld.autograd.joint import ModuleState, StateReader

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    state = [ModuleState("0.weight", "parameter"), ModuleState("1.running_mean", "buffer")]
    reader = StateReader(model, state)
    assert reader.read()[0] is model[0].weight and reader.read()[1] is model[1].running_mean
    model[0].weight = nn.Parameter(torch.randn(2, 3))
    model[1].running_mean = torch.ones(2)
    weight, mean = reader.read()
    assert weight is model[0].weight and mean is model[1].running_mean
    del model[0].weight
    model[0].weight = torch.zeros(2, 3)  # a plain tensor attribute now
    assert reader.read()[0] is model[0].weight

    class Shadowed(nn.Linear):
        pass

    shadowed = Shadowed(3, 2)
    # a class attribute of the parameter's name, a property here, wins under getattr
    Shadowed.bias = property(lambda self: self._parameters["bias"] * 0)
    (bias,) = StateReader(shadowed, [ModuleState("bias", "parameter")]).read()
    assert torch.equal(bias, torch.zeros(2))


def test_replaced_parameter_is_trained_through_a_compiled_graph():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torchweld.compile(model, backend="weld")
    x = torch.randn(3, 4)
    compiled(x).sum().backward()
    model[2].weight = nn.Parameter(torch.randn(2, 4))  # the module's next call reads the new one
    model.zero_grad()
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert model[2].weight.grad is not None
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()  # eager's gradients for the replaced weight and the rest
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_outputs_that_view_an_input_written_in_place_stay_views_of_it():
    """`x.add_(1); return x.t()`: the functional graph computes the output from x's new value;
    eager's output shares x's memory, and so must the compiled one's once x is written."""
    import torchweld

    def fn(x, w):
        x.add_(1)
        return (x * w).sum(), x.t(), x

    compiled = torchweld.compile(fn)
    for call in range(3):
        x, w = torch.arange(6.0).reshape(2, 3) + call, torch.randn(3, requires_grad=True)
        x_eager, w_eager = x.clone(), w.detach().clone().requires_grad_()
        total, transposed, same = compiled(x, w)
        eager_total, eager_transposed, _ = fn(x_eager, w_eager)
        total.backward()
        eager_total.backward()
        torch.testing.assert_close((total, transposed, x, w.grad), (eager_total, eager_transposed, x_eager, w_eager.grad))
        assert transposed.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert transposed.stride() == eager_transposed.stride() and same.data_ptr() == x.data_ptr()


def test_an_output_that_is_an_input_is_that_input():
    """`x.to(x.dtype)` is x in eager; a custom autograd Function returns a view of it instead,
    so the compiled call's output was a new tensor."""
    import torchweld

    def fn(x, w):
        return x.to(torch.float32), (x * w).sum()

    compiled = torchweld.compile(fn)
    for call in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        same, total = compiled(x, w)
        assert same is x
        (same.sum() + total).backward()
        x_eager, w_eager = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        eager_same, eager_total = fn(x_eager, w_eager)
        (eager_same.sum() + eager_total).backward()
        torch.testing.assert_close((x.grad, w.grad), (x_eager.grad, w_eager.grad))


def test_a_tensor_saved_for_backward_changed_in_place_runs_eagerly(caplog):
    """`t = maximum(x, w); w[1:] = 0`: eager's forward runs (a backward through t would fail);
    weld's joint trace ran that backward at compile time and raised to the user."""
    import logging

    import torchweld

    def fn(x, w):
        t = torch.maximum(x, w)
        w[1:] = 0.0
        return t

    compiled = torchweld.compile(fn)
    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        for _ in range(3):
            x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
            w_eager = w.clone()
            torch.testing.assert_close(compiled(x, w), fn(x, w_eager))
            torch.testing.assert_close(w, w_eager)
    assert "saved for backward" in caplog.text


def test_an_output_viewed_under_no_grad_of_a_tracked_tensor_runs_eagerly(caplog):
    """Fuzzer class 22: `with no_grad(): v = h.narrow(...)` of a tracked h, returned before a break.
    Autograd says v requires grad and gives it no history; the joint trace raised
    BackendCompilerFailed. The graph runs as captured, as eager: v requires grad."""
    import logging

    import torchweld

    def fn(x):
        h = x.sort(dim=0).values
        with torch.no_grad():
            h = h.narrow(1, 0, 4)
        if (h > 0.5).any():
            pass
        return h

    compiled = torchweld.compile(fn)
    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        for _ in range(3):
            x = torch.randn(3, 4, requires_grad=True)
            out, expected = compiled(x), fn(x)
            torch.testing.assert_close(out, expected)
            assert out.requires_grad == expected.requires_grad
    assert "view made under no_grad" in caplog.text


def test_a_view_made_and_written_under_no_grad_of_a_tracked_tensor_trains():
    """Fuzz case 103000405: `with no_grad(): h.view(-1).clamp_(min=0)` of a tracked h, then a break.
    Functionalizing the recorded graph replayed that write in grad mode, which autograd forbids
    for a view made under no_grad (BackendCompilerFailed). Outputs and gradients as eager's."""
    import torchweld

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def fn(x):
        h = lin(x) * 2
        with torch.no_grad():
            h.view(-1).clamp_(min=0)
        if h.mean() < 0:
            h = h + 1
        return h

    compiled = torchweld.compile(fn)
    for _ in range(3):
        x = torch.randn(3, 4)
        grads = []
        for f in (fn, compiled):
            out = f(x)
            out.sum().backward()
            grads.append((out.detach(), lin.weight.grad.clone(), lin.bias.grad.clone()))
            lin.zero_grad()
        torch.testing.assert_close(grads[0], grads[1])


def test_a_written_input_sharing_memory_with_another_input_in_training():
    """Fuzzer class 10 in a training graph: y = x.detach() written in place, x read after. A call
    whose inputs share memory runs the captured graph op by op; the others run the compiled one.
    Outputs, inputs and gradients as eager's on every call."""
    import torchweld

    w = torch.randn(4, 4, requires_grad=True)

    def fn(x, y):
        y.mul_(-1)
        return ((x - y) * w).sum(), x * 2

    compiled = torchweld.compile(fn)
    for call in range(4):
        results = []
        for f in (compiled, fn):
            w.grad = None
            x = torch.arange(16.0).reshape(4, 4) + call
            y = x.detach() if call % 2 else x.clone()
            loss, twice = f(x, y)
            loss.backward()
            results.append((loss, twice, x, y, w.grad))
        torch.testing.assert_close(*results)


def test_outputs_that_view_an_input_can_be_changed_in_place():
    """A custom autograd Function's output that views its input may not be changed in place
    ("Output 0 of CompiledGraphFunction is a view and is being modified inplace"); eager's view may.
    Such outputs are taken again of the input outside the Function. Gradients as eager's."""
    import torchweld

    w = torch.randn(4, 3, requires_grad=True)

    def fn(x):
        v = x.t()
        print(end="")  # a graph break: v leaves the graph
        v.add_(1)
        return v * 2, x[1:]

    compiled = torchweld.compile(fn)
    for call in range(3):
        results = []
        for f in (compiled, fn):
            w.grad = None
            leaf = torch.randn(3, 4, generator=torch.Generator().manual_seed(call), requires_grad=True)
            twice, rows = f(leaf * 1)
            rows.mul_(w[0, 0])
            ((twice * w).sum() + rows.sum()).backward()
            results.append((twice, rows, leaf.grad, w.grad, rows._is_view()))
        torch.testing.assert_close(*results)
