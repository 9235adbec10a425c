"""The weld backend on whole models, against eager; its training fallback and logs."""
import logging
import os

import pytest
import torch
import torch.nn as nn

from tests.models import CNN, Block
from torchweld.backends import lookup_backend


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU()) for _ in range(2)])

    def forward(self, x):
        return self.layers(x)


def _eval(model):
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model


def compile_weld(model, inputs, **kw):
    gm = torch.fx.symbolic_trace(model)
    return lookup_backend("weld", **kw)(gm, list(inputs))


@pytest.mark.parametrize("make,shape", [(MLP, (8, 32)), (CNN, (2, 3, 12, 12)), (Block, (2, 8, 32))])
def test_models_match_eager(make, shape):
    model = _eval(make())
    x = torch.randn(shape)
    with torch.no_grad():
        compiled = compile_weld(model, [x])
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        x2 = torch.randn(shape)  # a second input through the same kernels
        torch.testing.assert_close(compiled(x2), model(x2), atol=1e-4, rtol=1e-4)


def test_conv_bn_folded_under_no_grad():
    model = _eval(CNN())
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = compile_weld(model, [x])
    ops = compiled.schedule.graph.externs
    assert "aten.convolution.default" in ops and not any("batch_norm" in o for o in ops)


def test_training_runs_eagerly_and_logs_once(caplog):
    model = MLP()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        fn = compile_weld(model, [x])
    out = fn(x)
    out.sum().backward()  # autograd works
    assert model.layers[0][0].weight.grad is not None
    assert not hasattr(fn, "schedule")


def test_weld_logs_externs(caplog):
    with caplog.at_level(logging.DEBUG, logger="torchweld.weld"), torch.no_grad():
        compile_weld(nn.Linear(4, 4), [torch.randn(2, 4)])
    assert "aten.mm.default" in caplog.text


def test_output_code_log_and_disk_cache(caplog, tmp_path):
    from torchweld import config

    with config.patch(cache_dir=str(tmp_path)), caplog.at_level(logging.INFO, logger="torchweld.output_code"):
        with torch.no_grad():
            compiled = compile_weld(lambda x: torch.sin(x) * 2, [torch.randn(8)]) if False else None
            gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) * 2 + 1)
            compiled = lookup_backend("weld")(gm, [torch.randn(8)])
    assert "def call(" in caplog.text and "extern \"C\" void kernel0" in caplog.text
    assert os.path.exists(compiled.paths["cpp"]) and compiled.paths["cpp"].startswith(str(tmp_path))


def test_mutated_input_is_written_back():
    def fn(x):
        x.add_(1)
        return x * 2

    gm = torch.fx.symbolic_trace(fn)
    x = torch.randn(5)
    expected_x = x.clone() + 1
    with torch.no_grad():
        compiled = lookup_backend("weld")(gm, [x.clone()])
        out = compiled(x)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, expected_x * 2)


def test_detached_views_do_not_require_grad_without_autograd():
    """A graph that records no autograd (under no_grad, or only detached values) returns
    `x.detach()` as a view of `x`; eager's does not require grad, and neither may ours, while
    a view made under no_grad still does, as eager's."""
    import torchweld

    loss = (torch.randn(3, requires_grad=True) * 2).sum()
    w = nn.Parameter(torch.randn(2, 3))
    cases = [(lambda t: t.detach(), True), (lambda t: (t.detach(), t.detach() + 1), True),
             (lambda t: (w, w.detach()[0], w.t()), False), (lambda t: t.view(-1).detach(), False)]
    for fn, grad_mode in cases:
        with torch.set_grad_enabled(grad_mode):
            got, expected = torchweld.compile(fn, backend="weld")(loss), fn(loss)
        got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
            assert (a.requires_grad, a.grad_fn is None) == (b.requires_grad, b.grad_fn is None)


def test_outputs_are_one_object_where_eager_returns_one_object():
    """An op that returns its input itself (`.to` its own dtype, `.contiguous()` of a contiguous
    tensor) makes two outputs one object in eager; two views made apart stay two objects.
    Identity of the outputs as eager's (fuzzer case 141000242), on inputs' views and intermediates."""
    import torchweld

    cases = [lambda y: (y.reshape(y.shape), y.reshape(y.shape).to(torch.float32)),
             lambda y: (lambda x: (x, x.to(torch.float32), x.contiguous()))(y.view(12)),
             lambda y: (y.view(12), y.view(12), y.t(), y.t().contiguous()),
             lambda y: (lambda x: (x, x.float(), x.view(12)))(y * 2)]
    for fn in cases:
        compiled = torchweld.compile(fn, backend="weld")
        for _ in range(3):
            y = torch.randn(3, 4)
            got, expected = compiled(y), fn(y)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b)
            same = lambda outs: [[a is b for b in outs] for a in outs]  # noqa: E731
            assert same(got) == same(expected)


# -- graphs weld runs without its kernels (backends/weld_declines.py) -------------------


def test_meta_tensors_run_without_kernels_and_log_why(caplog):
    """A meta tensor's data pointer in a C++ kernel crashed the process (SIGSEGV)."""
    import torchweld

    def fn(x, y):
        return (x * 2 + y).sin().sum(0)

    compiled = torchweld.compile(fn)
    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        for n in (4, 4, 6):
            x, y = torch.randn(n, 3, device="meta"), torch.randn(3, device="meta")
            out = compiled(x, y)
            assert out.device.type == "meta" and out.shape == fn(x, y).shape
    assert "a tensor on meta" in caplog.text


def test_symbolic_sizes_from_torch_compile_compile_per_size():
    """torch.compile marks a dim dynamic when a second call changes it; weld computed with the
    first example's sizes (x.sum() of torch.ones(6) was 5.0 after a call with 5 elements). Now
    each size gets its own specialization (backends/weld_sizes.py), keyed on the sizes and on
    the symbolic sizes torch.compile passes as numbers."""
    weld = lookup_backend("weld")
    compiled = torch.compile(lambda x, w: (x * w).sum() + x.mean(0) * 2, backend=weld)
    for n in (5, 6, 7, 9, 3, 6):
        x, w = torch.randn(n, 4), torch.randn(4)
        torch.testing.assert_close(compiled(x, w), (x * w).sum() + x.mean(0) * 2)
    ones = torch.compile(lambda x: x.sum(), backend=weld)
    for n in (5, 6, 7, 100):
        torch.testing.assert_close(ones(torch.ones(n)), torch.tensor(float(n)))


def test_symbolic_sizes_in_node_metas_are_found():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torchweld.backends.weld_declines import Decline, why_declined

    gm = torch.fx.symbolic_trace(lambda x: x.sum())
    assert why_declined(gm, [torch.ones(5)]) is None
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = mode.from_tensor(torch.ones(5), symbolic_context=None)
        size = mode.shape_env.create_unbacked_symint()
    next(iter(gm.graph.nodes)).meta["example_value"] = torch.empty(size, device="meta")
    assert why_declined(gm, [torch.ones(5)])[0] is Decline.SYMBOLIC_SIZES
    assert why_declined(torch.fx.symbolic_trace(lambda x: x.sum()), [size, fake])[0] is Decline.SYMBOLIC_SIZES


def test_batch_norm_statistics_are_updated_behind_a_reshape():
    """A training-mode BatchNorm1d(1) over `(x * 1.0).reshape(-1, 1)`: its running
    statistics (get_attr constants of the graph) were never written back."""
    import torchweld

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(1)
            self.seq = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

        def forward(self, x):
            acc = x * 1.0
            return self.bn(acc.reshape(-1, 1)), self.seq(x.reshape(-1, 3))

    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    compiled = torchweld.compile(model)
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(12) + call
            torch.testing.assert_close(compiled(x), reference(x))
            for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
                torch.testing.assert_close(mine, theirs, msg=name)


def _batch_norm_calls_match_eager(fn, model: nn.Module, between=lambda call, model: None, calls: int = 4):
    """`fn(model, x)` compiled and eagerly (on a copy of `model`), for `calls` calls with
    `between(call, model)` changing both models first: outputs, and every entry of the state
    dicts (running statistics, batch counters) after each call, as eager's."""
    import copy

    import torchweld

    reference = copy.deepcopy(model)
    compiled = torchweld.compile(fn)
    for call in range(calls):
        between(call, model)
        between(call, reference)
        x = torch.randn(6, 4) + call
        with torch.set_grad_enabled(call % 2 == 0):
            torch.testing.assert_close(compiled(model, x), fn(reference, x))
        for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(mine, theirs, msg=f"call {call}: {name}")


def test_a_changed_batch_norm_momentum_reaches_the_kernels():
    """Fuzz case 21000326: `bn.momentum = 0.5` between calls. weld's kernels held the momentum
    of the first call (capture does not guard a leaf module's settings): the running
    statistics came out wrong. A setting met before reuses its compiled graph."""
    def between(call, model):
        model[1].momentum = [0.1, 0.1, 0.5, None, 0.1][call]
        model[1].eps = 1e-3 if call == 4 else 1e-5

    def fn(model, x):
        return model(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    _batch_norm_calls_match_eager(fn, model, between, calls=5)


def test_a_batch_norm_called_twice_under_no_grad_updates_its_counter_twice(caplog):
    """A training-mode batch norm called twice in one inference graph: the second
    `num_batches_tracked.add_(1)` writes the first one's result, which the lowering took for a
    view of the constant it could not place (the graph ran eagerly)."""
    def fn(model, x):
        t = model[1](x)
        return model(t) + model[1](x)

    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        _batch_norm_calls_match_eager(fn, nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert "weld cannot" not in caplog.text


def test_a_batch_norm_with_a_cumulative_average_runs_as_captured(caplog):
    """momentum=None divides by the batch counter as a Python number: capture reads the real
    buffer, weld's trace a fake one (DataDependentOutputException, raised to the user)."""
    def fn(model, x):
        return model(x).relu()

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        _batch_norm_calls_match_eager(fn, model)
    assert "weld cannot trace this graph" in caplog.text


def test_an_enable_grad_block_in_a_graph_called_under_no_grad_is_trained():
    """Fuzz case 34000274: under no_grad, `with torch.enable_grad(): y = (x * w).sigmoid()` requires
    grad in eager; weld took the graph for inference (grad mode was off) and y did not."""
    import torchweld

    w = torch.randn(4, requires_grad=True)

    def fn(x):
        with torch.enable_grad():
            y = (x * w).sigmoid()
        return y, x * w

    compiled = torchweld.compile(fn)
    for call in range(3):
        results = []
        for f in (compiled, fn):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(call))
            with torch.no_grad():
                y, z = f(x)
            w.grad = None
            y.sum().backward()
            results.append((y, z, y.requires_grad, z.requires_grad, w.grad))
        torch.testing.assert_close(*results)
