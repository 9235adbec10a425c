"""Guards: what makes a compiled version reusable, recompiles, the cache-size
limit, identity guards that do not keep objects alive."""
import gc
import logging
import sys
import time
import weakref

import pytest
import torch
import torch.nn as nn

import torchweld
from tests.capture.helpers import CountingBackend


def test_new_shape_dtype_and_requires_grad_recompile():
    backend = CountingBackend()
    fn = torchweld.compile(lambda x: x.sin() + 1, backend=backend)
    inputs = [torch.randn(4), torch.randn(8), torch.randn(8).double(), torch.randn(8, requires_grad=True),
              torch.randn(8, 2).t()[0]]  # the last one: a non-contiguous view with other strides
    for x in inputs:
        torch.testing.assert_close(fn(x), x.sin() + 1)
    assert len(backend.graphs) == len(inputs)
    for x in inputs:  # every version is still cached
        fn(x)
    assert len(backend.graphs) == len(inputs)


def test_python_constant_change_recompiles():
    backend = CountingBackend()
    fn = torchweld.compile(lambda x, k: x * k, backend=backend)
    x = torch.randn(3)
    for k in (2, 3, 2.0, True):
        torch.testing.assert_close(fn(x, k), x * k)
    assert len(backend.graphs) == 4  # 2 and 2.0 and True are different guards


SCALE = 2.0


def scaled(x):
    return x * SCALE


def test_global_change_recompiles():
    global SCALE
    fn = torchweld.compile(scaled)
    x = torch.randn(3)
    torch.testing.assert_close(fn(x), x * 2.0)
    SCALE = 5.0
    try:
        torch.testing.assert_close(fn(x), x * 5.0)
    finally:
        SCALE = 2.0


def helper_with_defaults(x, scale=2.0, shift=None, flip=False):
    y = x * scale
    return y if shift is None else y + shift


def calls_helper_with_defaults(x):
    return helper_with_defaults(x) - 1


def test_changed_defaults_recompile_and_one_guard_covers_the_tuple():
    backend = CountingBackend()
    fn = torchweld.compile(calls_helper_with_defaults, backend=backend)
    x = torch.randn(3)
    original = helper_with_defaults.__defaults__
    torch.testing.assert_close(fn(x), x * 2.0 - 1)
    texts = [g for g in torchweld.explain(calls_helper_with_defaults)(x).guards if "__defaults__" in g]
    assert len(texts) == 1 and "__defaults__[" not in texts[0]  # the tuple, not each entry
    try:
        helper_with_defaults.__defaults__ = (3.0, 1.0, False)
        torch.testing.assert_close(fn(x), x * 3.0 + 1.0 - 1)
        assert len(backend.graphs) == 2
    finally:
        helper_with_defaults.__defaults__ = original


def test_grad_mode_is_guarded():
    w = torch.randn(3, requires_grad=True)
    fn = torchweld.compile(lambda x: x * w)
    x = torch.randn(3)
    assert fn(x).requires_grad
    with torch.no_grad():
        assert not fn(x).requires_grad


def _autocast_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_autocast_state_is_guarded(backend):
    """A graph captured under torch.autocast has its casts in it (weld traces them into the
    aten graph): reused outside autocast it returned bfloat16. Either order, like torch.compile."""
    model, x = _autocast_model(), torch.randn(4, 8)
    expected = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected["bf16"] = model(x)
    expected["off"] = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        expected["bf16 uncached"] = model(x)
    for order in (["bf16", "off", "bf16 uncached"], ["off", "bf16", "bf16 uncached"]):
        compiled = torchweld.compile(model, backend=backend)
        for state in order + order:
            context = (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=state != "bf16 uncached")
                       if state != "off" else torch.autocast("cpu", enabled=False))
            with context:
                got = compiled(x)
            assert got.dtype == expected[state].dtype, (order, state)
            torch.testing.assert_close(got, expected[state], atol=2e-2, rtol=2e-2)


def test_autocast_guards_match_torch_compile():
    """torch.compile recompiles for a new autocast state too; both give eager's dtypes."""
    model, x = _autocast_model(), torch.randn(4, 8)
    ours, theirs = torchweld.compile(model), torch.compile(model, backend="eager")
    for enabled in (True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            assert ours(x).dtype == theirs(x).dtype == model(x).dtype


def test_autocast_guard_reads_as_one_line():
    explained = torchweld.explain(lambda x: x * 2)(torch.randn(3))
    assert "torch.autocast is off" in str(explained)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torchweld.explain(lambda x: x * 2)(torch.randn(3))
    assert "torch.autocast state is (torch.bfloat16, None, True)" in str(explained)


def test_autocast_inside_the_frame_is_captured():
    model, x = _autocast_model(), torch.randn(4, 8)

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        return y.float() + 1

    explained = torchweld.explain(fn)(x)
    assert explained.graph_break_count == 0  # tests/capture/test_autocast.py has the rest
    torch.testing.assert_close(torchweld.compile(fn)(x), fn(x), atol=2e-2, rtol=2e-2)


def test_eval_mode_and_submodule_swap_are_guarded():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))
    fn = torchweld.compile(model)
    x = torch.randn(8, 4)
    model.eval()
    torch.testing.assert_close(fn(x), model(x))
    model[0] = nn.Linear(4, 4)  # a different submodule object: identity guard fails
    torch.testing.assert_close(fn(x), model(x))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.register_buffer("scale", torch.tensor(2.0))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.inner(x) * self.scale + self.bias


def test_module_entries_read_from_their_dicts_follow_replacement():
    """Children, buffers and parameters are guarded and read through `_modules`,
    `_buffers` and `_parameters`: replacing any of them is seen, and the entry's
    source reads the dicts instead of calling nn.Module.__getattr__."""
    model, x = Scaled(), torch.randn(3, 4)
    fn = torchweld.compile(model, backend="eager")
    torch.testing.assert_close(fn(x), model(x))
    model.scale = torch.tensor(3.0)  # a new buffer tensor
    torch.testing.assert_close(fn(x), model(x))
    model.bias = nn.Parameter(torch.zeros(4))  # a new parameter
    torch.testing.assert_close(fn(x), model(x))
    model.inner[1] = nn.Tanh()  # a new child of a child
    torch.testing.assert_close(fn(x), model(x))
    with torch.no_grad():
        model.inner[0].weight.mul_(2)  # in place: read live
    torch.testing.assert_close(fn(x), model(x))


def test_module_entry_source_spelling():
    from torchweld.capture.objects import attribute_source
    from torchweld.capture.sources import LocalSource

    model, self_ = Scaled(), LocalSource("self")
    assert attribute_source(self_, model, "inner").expr() == "self._modules['inner']"
    assert attribute_source(self_, model, "scale").expr() == "self._buffers['scale']"
    assert attribute_source(self_, model, "bias").expr() == "self._parameters['bias']"
    assert attribute_source(self_, model, "training").expr() == "self.training"  # in the instance dict
    assert attribute_source(self_, model, "inner").name() == "L['self'].inner"  # reads as an attribute


def test_cache_size_limit_warns_naming_the_guard_then_runs_eagerly():
    backend = CountingBackend()
    fn = torchweld.compile(lambda x: x + 1, backend=backend, dynamic=False)  # every size a new version
    with torchweld.config.patch(cache_size_limit=2):
        fn(torch.randn(1))
        fn(torch.randn(2))
        with pytest.warns(UserWarning, match=r"cache_size_limit=2.*L\['x'\]\.shape == \(2,\) \(got \(3,\)\)") as caught:
            out = fn(torch.randn(3))
        torch.testing.assert_close(out.shape, torch.Size([3]))
        assert caught[0].filename == __file__  # pointed at the user's call
        fn(torch.randn(4))  # one warning only
    assert len(backend.graphs) == 2


def test_recompiles_log_names_failing_guard(caplog):
    fn = torchweld.compile(lambda x: x + 1)
    with torchweld.config.patch(logs="recompiles"), caplog.at_level(logging.INFO, logger="torchweld"):
        fn(torch.randn(2))
        fn(torch.randn(2, 2))
    assert any("guard failed: L['x'].shape == (2,) (got (2, 2))" in r.getMessage() for r in caplog.records)


def test_guards_log_and_graph_log(caplog):
    fn = torchweld.compile(lambda x: x.cos())
    with torchweld.config.patch(logs="guards,graph,graph_code,bytecode"), caplog.at_level(logging.DEBUG, logger="torchweld"):
        fn(torch.randn(2))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "L['x']: Tensor(dtype=torch.float32" in text
    assert "cos" in text and "def forward" in text and "___entry" in text


def test_unknown_log_artifact_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown artifact 'graphs'"):
        torchweld.logs.parse("graphs")


def test_compiled_function_garbage_collected_frees_cache():
    model = nn.Linear(3, 3)
    fn = torchweld.compile(model)
    fn(torch.randn(2, 3))
    ref = weakref.ref(fn._compiled_forward)
    del fn
    # a background thread (the backward compiled ahead) may hold a frame a moment longer
    for _ in range(50):
        gc.collect()
        if ref() is None:
            return
        time.sleep(0.1)
    holders = [type(r).__name__ + ": " + repr(r)[:200] for r in gc.get_referrers(ref())]
    pytest.fail("the compiled function outlived its last reference; held by:\n" + "\n".join(holders))


class TwoLayers(nn.Module):
    def __init__(self, breaks: bool):
        super().__init__()
        self.a, self.b, self.breaks = nn.Linear(8, 8), nn.Linear(8, 8), breaks

    def forward(self, x):
        y = self.a(x).relu()
        if self.breaks:
            print("", end="")  # a graph break: a resume function and its own cache
        return self.b(y)


@pytest.mark.parametrize("backend", ["eager", "weld"])
@pytest.mark.parametrize("breaks", [False, True])
def test_dropped_model_is_freed_without_the_cyclic_gc(backend, breaks):
    """No reference cycle runs from a compiled function's cache to the user's model: dropping
    the model and its compiled version frees its parameters at once (issue 44)."""
    torchweld.compile(TwoLayers(breaks), backend=backend)(torch.randn(2, 8))  # one-time imports and set-up
    model = TwoLayers(breaks)
    compiled = torchweld.compile(model, backend=backend)
    calling = torchweld.compile(lambda x: model(x) + 1, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8))
            calling(torch.randn(2, 8))
    weight = weakref.ref(model.a.weight)
    gc.collect()  # what compiling left for the collector: young garbage, collected soon in any program
    gc.disable()
    try:
        del model, compiled, calling
        assert weight() is None, "the model outlived its compiled versions until the cyclic GC runs"
    finally:
        gc.enable()


class Scale(nn.Module):  # a user module: inlined, so the graph holds no reference to it
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


def test_identity_guard_does_not_keep_module_alive():
    def call(m, x):
        return m(x)

    model = Scale()
    fn = torchweld.compile(call)
    fn(model, torch.randn(3))
    ref = weakref.ref(model)
    entry = fn.cache_entries[0]
    assert entry.alive
    del model
    gc.collect()
    assert ref() is None and not entry.alive  # its id may be reused: the entry is dropped
    assert entry not in fn.cache_entries  # and never checked again
    other = Scale()
    torch.testing.assert_close(fn(other, torch.ones(3)), torch.ones(3))


def test_readable_guards_cover_what_the_graph_assumed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.k = 3

        def forward(self, x, flag=True):
            return self.fc(x) * self.k if flag else x

    report = torchweld.explain(M())(torch.randn(1, 2))
    guards = "\n".join(report.guards)
    for expected in ("torch.is_grad_enabled() is True", "L['x']: Tensor", "L['flag'] is True",
                     "L['self'].k == 3", "L['self'].fc.training is True", "L['self'].fc is <"):
        assert expected in guards, expected


def test_reads_shared_by_graph_inputs_are_made_once():
    from torchweld.capture.sources import AttrSource, GlobalSource, ItemSource, shared_reads

    params = ItemSource(ItemSource(AttrSource(GlobalSource("opt"), "param_groups"), 0), "params")
    sources = [ItemSource(params, i) for i in range(3)] + [AttrSource(GlobalSource("x"), "w")]
    lines, exprs = shared_reads(sources)
    assert lines == ["___s0 = ___G['opt']", "___s1 = ___s0.param_groups", "___s2 = ___s1[0]",
                     "___s3 = ___s2['params']"]
    assert exprs == ["___s3[0]", "___s3[1]", "___s3[2]", "___G['x'].w"]


def test_a_guarded_object_dying_after_the_finalizer_released_the_entries(monkeypatch):
    """At interpreter exit the finalizer releases a compiled function's entries first; an
    identity guard's object dying after it must not raise inside the weakref callback (it
    printed "Exception ignored ... list.remove(x): x not in list")."""
    from torchweld.capture import compiled_function

    def call(m, x):
        return m(x)

    model = Scale()
    fn = torchweld.compile(call)
    fn(model, torch.randn(3))
    cache = fn.cache_entries[0]
    compiled_function._release_all(fn._unreleased)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    del model
    gc.collect()
    assert not unraisable and not cache.alive


class TryBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        try:
            if x.sum() > 0:  # a break inside a try: a native resume handing over to a compiled one
                x = x + 1
            return self.a(x)
        except ValueError:
            return x


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_model_with_a_break_inside_a_try_is_freed_once_dropped(backend):
    model = TryBreak()
    # (no backward compiled ahead: under a loaded CI host its thread still held the graph at the check)
    options = {"backward_ahead": False} if backend == "weld" else None
    compiled = torchweld.compile(model, backend=backend, options=options)
    for sign in (1, -1):
        torch.testing.assert_close(compiled(torch.ones(2, 4) * sign), model(torch.ones(2, 4) * sign))
    weight = weakref.ref(model.a.weight)
    del model, compiled
    gc.collect()
    assert weight() is None, "a resume function's code (cached process-wide) kept the compiled model alive"
