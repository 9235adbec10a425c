"""weld's compile per size for graphs with symbolic sizes (backends/weld_sizes.py), its fallback
where it cannot compile one over its symbols: one capture, a compile per concrete size from that
size's second call, every size's result equal to eager's, in training too."""
from __future__ import annotations

import logging

import pytest
import torch

import torchweld
from torchweld.backends.weld_sizes import CompiledPerSize
from tests.capture.test_dynamic_shapes import Block


# the compile per size, which weld falls back to where it cannot compile a graph over its
# symbols (test_weld_symbolic.py), asked for directly
PER_SIZE = {"symbolic_kernels": False}


def _per_size(fn) -> CompiledPerSize:
    (entry,) = [e for e in fn.cache_entries if isinstance(e.namespace.get("___graph"), CompiledPerSize)]
    return entry.namespace["___graph"]


def f(x, y):
    n = x.shape[0]
    z = x.view(n, -1) * 2 + y
    return z[: n // 2].sum(0) + torch.arange(n, dtype=x.dtype).sum(), (z.softmax(-1) * x.shape[-1] ** 0.5).sum(0)


def test_each_size_equals_eager_and_capture_happens_once():
    fn = torchweld.compile(f, backend="weld", dynamic=True, options=PER_SIZE)
    for n in (6, 9, 7, 13, 10, 6, 9, 7, 13, 10, 6):
        x, y = torch.randn(n, 5), torch.randn(n, 5)
        torch.testing.assert_close(fn(x, y), f(x, y))
    assert len(fn.cache_entries) == 1
    per_size = _per_size(fn)
    assert per_size.compiles == 5 and per_size.calls_as_captured == 5  # each size's first call runs as captured


def test_sizes_seen_once_compile_nothing():
    """A generation loop whose length grows by one each call: no compile per token."""
    fn = torchweld.compile(f, backend="weld", dynamic=True, options=PER_SIZE)
    for n in range(4, 40):
        x, y = torch.randn(n, 5), torch.randn(n, 5)
        torch.testing.assert_close(fn(x, y), f(x, y))
    assert _per_size(fn).compiles == 0
    x, y = torch.randn(20, 5), torch.randn(20, 5)
    torch.testing.assert_close(fn(x, y), f(x, y))  # a second call of 20: the last 4 * limit sizes are counted
    assert _per_size(fn).compiles == 1


def test_specializations_share_their_triton_kernels():
    """Kernels that differ only in sizes take them as arguments: one source for every size."""
    fn = torchweld.compile(f, backend="weld", dynamic=True, options={**PER_SIZE, "cpu_codegen": "triton"})
    for n in (40, 40, 56, 56):
        x, y = torch.randn(n, 5), torch.randn(n, 5)
        torch.testing.assert_close(fn(x, y), f(x, y))
    first, second = (c.kernel_sources["triton"] for c in _per_size(fn).specializations.values())
    assert first == second


def test_automatic_dynamic_transformer_block_on_weld():
    torch.manual_seed(0)
    block = Block().eval()
    fn = torchweld.compile(block, backend="weld", options=PER_SIZE)
    with torch.no_grad():
        for t in (7, 10, 13, 9):
            x = torch.randn(2, t, 16)
            torch.testing.assert_close(fn(x), block(x), rtol=1e-4, atol=1e-5)


def test_past_the_limit_sizes_run_as_captured_with_a_log_line(caplog):
    """No size is dropped and compiled again (a cache that evicted compiled at every call of a
    loop over more sizes than it kept): past the limit, new sizes run as captured."""
    fn = torchweld.compile(f, backend="weld", dynamic=True, options={**PER_SIZE, "size_specializations": 2})
    with torchweld.config.patch(logs="dynamic"), caplog.at_level(logging.INFO, logger="torchweld"):
        for _ in range(3):
            for n in (6, 7, 8):
                x, y = torch.randn(n, 5), torch.randn(n, 5)
                torch.testing.assert_close(fn(x, y), f(x, y))
    per_size = _per_size(fn)
    assert per_size.compiles == 2 and set(per_size.specializations) == {(6, 5), (7, 5)}
    assert per_size._reads is not None  # keyed by the symbols' values: capture's guards fix the rest
    said = [r.getMessage() for r in caplog.records if "compiled this graph for 2 sizes" in r.getMessage()]
    assert len(said) == 1 and "[(6, 5), (6, 5)], [(7, 5), (7, 5)]" in said[0]


def test_training_with_varying_length_gives_eager_gradients_on_weld():
    torch.manual_seed(0)
    model, reference = Block(), Block()
    reference.load_state_dict(model.state_dict())
    compiled = torchweld.compile(model, backend="weld", options=PER_SIZE)
    for t in (5, 8, 6, 11):
        x = torch.randn(2, t, 16)
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-5)
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    # each length's second call compiles it (the first length's graph was a static one)
    assert _per_size(compiled._compiled_forward).compiles == 3


def test_cpp_specializations_share_one_library():
    """On the CPU too the specializations take their loops' sizes as arguments: the transformer
    block's kernels for lengths 10, 13 and 31 are one C++ file, built once."""
    torch.manual_seed(0)
    block = Block().eval()
    compiled = torchweld.compile(block, backend="weld", options=PER_SIZE)
    with torch.no_grad():
        for t in (7, 10, 10, 13, 13, 31, 31, 13):
            x = torch.randn(2, t, 16)
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-4, atol=1e-5)
    per_size = _per_size(compiled._compiled_forward)
    assert per_size.compiles == 3
    assert len({c.paths["cpp"] for c in per_size.specializations.values()}) == 1
    assert "const int64_t ks0" in next(iter(per_size.specializations.values())).kernel_sources["cpp"]


def _kinds_of_kernels(x, y):
    """A row reduction walked in chunks (rows of 300), a column sum (an outer reduction), a
    concatenation (pieces), a softmax over the changing dim, and pointwise work on views."""
    rows = x.sum(-1, keepdim=True)
    cols = x.sum(0)
    joined = torch.cat([x[:, :7] * 2, y], dim=1)
    return rows * x.softmax(0) + cols, joined.relu().mean(0), x.t()[1:4].exp().sum()


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_every_kind_of_kernel_takes_or_keeps_its_sizes_soundly(codegen):
    fn = torchweld.compile(_kinds_of_kernels, backend="weld", dynamic=True,
                           options={**PER_SIZE, "cpu_codegen": codegen})
    for n in (5, 9, 9, 5, 17, 17, 9, 33, 33):
        x, y = torch.randn(n, 300), torch.randn(n, 3)
        torch.testing.assert_close(fn(x, y), _kinds_of_kernels(x, y), rtol=1e-4, atol=1e-4)
    assert _per_size(fn).compiles == 4
