"""torchweld.compile's surface: call forms, modules, modes, backends and errors."""
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import torchweld
from tests.capture.helpers import CountingBackend


def sin_cos(x):
    """Docstring kept."""
    return torch.sin(x) + torch.cos(x)


class MyModule(nn.Module):  # the tutorial's module
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x))


def test_call_forms_keep_metadata():
    x = torch.randn(3)
    for compiled in (torchweld.compile(sin_cos), torchweld.compile()(sin_cos),
                     torchweld.compile(backend="eager")(sin_cos)):
        torch.testing.assert_close(compiled(x), sin_cos(x))
        assert compiled.__name__ == "sin_cos" and compiled.__doc__ == "Docstring kept."
        assert compiled.__wrapped__ is sin_cos


def test_decorator():
    @torchweld.compile
    def opt_foo2(x, y):
        a = torch.sin(x)
        b = torch.cos(y)
        return a + b

    x, y = torch.randn(10, 10), torch.randn(10, 10)
    torch.testing.assert_close(opt_foo2(x, y), torch.sin(x) + torch.cos(y))


def test_module_shares_state_and_forwards_attributes():
    mod = MyModule()
    opt = torchweld.compile(mod)
    x = torch.randn(10, 3)
    torch.testing.assert_close(opt(x), mod(x))
    assert list(opt.state_dict()) == list(mod.state_dict()) == ["lin.weight", "lin.bias"]
    assert [p is q for p, q in zip(opt.parameters(), mod.parameters())] == [True, True]
    assert opt.lin is mod.lin
    with torch.no_grad():
        mod.lin.weight.add_(1.0)  # weight updates are seen without recompiling
    torch.testing.assert_close(opt(x), mod(x))
    opt.eval()
    assert not mod.training and not mod.lin.training
    opt.train()
    assert mod.training
    opt.to(torch.float64)
    assert mod.lin.weight.dtype == torch.float64
    torch.testing.assert_close(opt(x.double()), mod(x.double()))
    mod.load_state_dict(opt.state_dict())


def test_module_hooks_on_the_original_still_run():
    mod = MyModule()
    calls = []
    mod.register_forward_hook(lambda m, i, o: calls.append(1))
    opt = torchweld.compile(mod)
    x = torch.randn(2, 3)
    torch.testing.assert_close(opt(x), mod(x))
    assert len(calls) == 2


def test_compiled_method_on_a_class():
    class Scaler(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 3.0

        @torchweld.compile
        def forward(self, x):
            return x * self.k

    s = Scaler()
    torch.testing.assert_close(s(torch.ones(2)), torch.full((2,), 3.0))


def test_custom_backend_receives_graph_and_example_inputs():
    seen = []

    def my_backend(gm, example_inputs):
        assert isinstance(gm, torch.fx.GraphModule)
        seen.append([tuple(t.shape) for t in example_inputs])
        assert all("example_value" in n.meta for n in gm.graph.nodes if n.op != "output")
        return gm.forward

    x = torch.randn(4, 2)
    torch.testing.assert_close(torchweld.compile(sin_cos, backend=my_backend)(x), sin_cos(x))
    assert seen == [[(4, 2)]]


def test_placeholders_named_after_sources():
    backend = CountingBackend()
    module, x = MyModule(), torch.randn(2, 3)
    torch.testing.assert_close(torchweld.compile(module, backend=backend)(x), module(x))
    names = [n.name for n in backend.graphs[0].graph.nodes if n.op == "placeholder"]
    assert names == ["l_x_"]


def test_registered_backend_and_list():
    @torchweld.register_backend("counting_for_test")
    def counting(gm, example_inputs):
        counting.calls += 1
        return gm.forward

    counting.calls = 0
    assert "counting_for_test" in torchweld.list_backends() and "eager" in torchweld.list_backends()
    x = torch.randn(2)
    torch.testing.assert_close(torchweld.compile(sin_cos, backend="counting_for_test")(x), sin_cos(x))
    assert counting.calls == 1


def test_backend_warm_up_sees_each_capture_first():
    """A backend's `warm_up(args, kwargs)` runs before capture, once per captured frame, with the
    call's arguments (weld's starts its CUDA helpers there); calls that hit the cache skip it."""
    events = []

    def backend(gm, example_inputs):
        events.append("compile")
        return gm.forward

    backend.warm_up = lambda args, kwargs: events.append(("warm_up", [tuple(a.shape) for a in args]))
    compiled = torchweld.compile(sin_cos, backend=backend)
    for shape in [(3,), (3,), (2, 2)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), sin_cos(x))
    assert events == [("warm_up", [(3,)]), "compile", ("warm_up", [(2, 2)]), "compile"]


def test_weld_warm_up_starts_cuda_helpers_only_for_cuda_calls(monkeypatch):
    """weld's warm_up starts its CUDA helpers (workers, driver, launcher) where a call's tensors,
    or the parameters of the module it is a method of, are on CUDA, and for nothing else."""
    import types

    from torchweld.backends import backend_warm_up
    from torchweld.backends import weld as weld_backend

    started = []
    monkeypatch.setattr(weld_backend, "_start_cuda_helpers", lambda workers: started.append(workers))
    warm_up = backend_warm_up("weld")
    assert warm_up is not None
    warm_up((torch.randn(2), MyModule()), {"y": torch.randn(3)})
    assert started == []

    class OnCuda(torch.nn.Module):  # stands for a module whose parameters are on CUDA
        def parameters(self, recurse=True):
            yield types.SimpleNamespace(is_cuda=True)

    warm_up((OnCuda(), torch.randn(2)), {})
    assert started == [torchweld.tuning.tuning.workers_at_first_call]


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_modes_accepted_and_passed_on(mode):
    received = []

    def backend(gm, example_inputs, mode=None, options=None):
        received.append((mode, options))
        return gm.forward

    x = torch.randn(2)
    torch.testing.assert_close(torchweld.compile(sin_cos, backend=backend, mode=mode, options={"k": 1})(x), sin_cos(x))
    assert received == [(mode, {"k": 1})]


def test_a_python_whose_bytecode_capture_does_not_read_runs_the_model_as_it_is(monkeypatch):
    from torchweld.capture import handlers

    newest = sys.version_info[:2]
    monkeypatch.setattr(handlers, "BYTECODE_VERSIONS", ((3, 0), (newest[0], newest[1] - 1)))

    def fn(x):
        return x + 1

    with pytest.warns(RuntimeWarning, match=rf"CPython 3.0 to .*; this is CPython {newest[0]}.{newest[1]}, so 'fn' runs"):
        compiled = torchweld.compile(fn)
    assert compiled is fn
    model = torch.nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match="runs as it is, not compiled"):
        assert torchweld.compile(model) is model


def test_disable_runs_natively():
    calls = []

    @torchweld.disable
    def side(x):
        calls.append(1)
        return x * 2

    def fn(x):
        return side(x) + 1

    x = torch.randn(3)
    torch.testing.assert_close(torchweld.compile(fn)(x), x * 2 + 1)
    assert calls == [1]
    torch.testing.assert_close(torchweld.compile(sin_cos, disable=True)(x), sin_cos(x))


# -- bad input ------------------------------------------------------------------------------------


def test_non_callable():
    with pytest.raises(torchweld.InvalidArgument, match="expects a function or an nn.Module, got int"):
        torchweld.compile(3)


def test_unknown_backend_and_mode():
    with pytest.raises(torchweld.InvalidArgument, match="unknown backend 'nope'; registered backends: .*eager"):
        torchweld.compile(sin_cos, backend="nope")
    with pytest.raises(torchweld.InvalidArgument, match="unknown mode 'fast'"):
        torchweld.compile(sin_cos, mode="fast")


def test_backend_that_raises():
    def broken(gm, example_inputs):
        raise RuntimeError("boom")

    compiled = torchweld.compile(sin_cos, backend=broken)
    with pytest.raises(torchweld.BackendCompilerFailed, match="backend 'broken' raised RuntimeError: boom") as info:
        compiled(torch.randn(2))
    assert "test_api.py" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_backend_that_raises_with_suppress_errors_runs_eagerly():
    def broken(gm, example_inputs):
        raise RuntimeError("boom")

    x = torch.randn(2)
    with torchweld.config.patch(suppress_errors=True), pytest.warns(UserWarning, match="boom"):
        torch.testing.assert_close(torchweld.compile(sin_cos, backend=broken)(x), sin_cos(x))


def test_backend_returning_non_callable():
    compiled = torchweld.compile(sin_cos, backend=lambda gm, inputs: 42)
    with pytest.raises(torchweld.BackendCompilerFailed, match="returned 42, which is not callable"):
        compiled(torch.randn(2))


def test_fullgraph_names_user_line():
    def needs_python(x):
        y = x + 1
        print("hello")
        return y

    with pytest.raises(torchweld.Unsupported) as info:
        torchweld.compile(needs_python, fullgraph=True)(torch.randn(2))
    message = str(info.value)
    assert "test_api.py:" in message and 'print("hello")' in message
    assert "print() needs Python" in message and "Remove fullgraph=True" in message


def test_unsupported_frame_runs_eagerly_and_is_explained(capsys):
    def data_dependent(x):
        if x.sum() > 0:
            return x + 1
        return x - 1

    compiled = torchweld.compile(data_dependent)
    for x in (torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(compiled(x), data_dependent(x))
    report = torchweld.explain(data_dependent)(torch.ones(3))
    assert report.graph_break_count == 1
    assert "data-dependent control flow" in report.break_reasons[0].reason
    assert "if x.sum() > 0:" in str(report)


def test_user_error_raises_the_eager_error():
    def bad(x):
        return x @ torch.randn(7, 7)

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torchweld.compile(bad)(torch.randn(2, 3))


def test_threads_translate_once():
    backend = CountingBackend()
    compiled = torchweld.compile(sin_cos, backend=backend)
    x = torch.randn(64)
    results, errors = [], []

    def worker():
        try:
            for _ in range(20):
                results.append(compiled(x))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 80
    for r in results:
        torch.testing.assert_close(r, sin_cos(x))
    assert len(backend.graphs) == 1


def test_reset_forgets_compiled_versions():
    backend = CountingBackend()
    compiled = torchweld.compile(sin_cos, backend=backend)
    compiled(torch.randn(2))
    torchweld.reset()
    compiled(torch.randn(2))
    assert len(backend.graphs) == 2


def test_no_warnings_on_the_happy_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchweld.compile(sin_cos)(torch.randn(2))


def test_compile_times_report_each_phase_and_log_each_frame(caplog):
    import logging

    from torchweld import timing

    timing.reset()
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU())
    compiled = torchweld.compile(model, backend="weld")
    x = torch.randn(4, 8)
    with torchweld.config.patch(logs="compile_times"), caplog.at_level(logging.INFO, logger="torchweld"), \
            torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    table = torchweld.compile_times("str")
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    for phase in ("capture", "backend", "weld.aten_graph", "weld.lower", "weld.schedule", "weld.render", "guards"):
        assert rows[phase][0] == "1" and float(rows[phase][1]) >= 0, table
    assert float(rows["capture"][1]) >= float(rows["backend"][1])  # phases nest: capture holds the backend
    [message] = [r.getMessage() for r in caplog.records if r.name == "torchweld.compile_times"]
    assert message.startswith("compiling Sequential.forward: capture ") and "weld.lower" in message
    timing.reset()
    assert torchweld.compile_times("str") == "no compile has run yet"
    assert torchweld.compile_times() == {}


def test_compile_trace_shows_each_phase_on_its_thread(tmp_path):
    import json

    from torchweld import timing

    timing.reset()
    path = tmp_path / "compile.json"
    with torchweld.config.patch(compile_trace=str(path)), torch.no_grad():
        x = torch.randn(4, 8)
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        torch.testing.assert_close(torchweld.compile(model, backend="weld")(x), model(x))
        timing.record("weld.triton_compile.workers.kernel", 0.25, "kernel_0")  # as a worker's reply is recorded
        timing.write_trace()
    events = json.loads(path.read_text())["traceEvents"]
    [worker] = [e for e in events if e["name"] == "weld.triton_compile.workers.kernel"]
    assert worker["args"] == {"detail": "kernel_0"} and worker["dur"] == 0.25e6
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert {"capture", "backend", "weld.lower", "weld.schedule"} <= set(spans)
    capture, lower = spans["capture"], spans["weld.lower"]  # nested phases lie inside their parent
    assert capture["ts"] <= lower["ts"] and lower["ts"] + lower["dur"] <= capture["ts"] + capture["dur"] + 1
    assert any(e["ph"] == "M" and e["args"]["name"] == "MainThread" for e in events)
    timing.reset()


def test_the_garbage_collector_is_held_off_while_compiling():
    """Compiling makes hundreds of thousands of objects; the cyclic collector waits until the
    backend is done (torchweld/gc_pause.py), and is left as the caller had it."""
    import gc

    seen = []

    def backend(gm, example_inputs):
        seen.append(gc.isenabled())
        return gm

    fn = torchweld.compile(lambda x: x.sin() + 1, backend=backend)
    assert gc.isenabled()
    x = torch.randn(3)
    torch.testing.assert_close(fn(x), x.sin() + 1)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        torchweld.compile(lambda x: x.cos() * 2, backend=backend)(torch.randn(3))
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_the_garbage_collector_stays_off_until_the_last_concurrent_compile_is_done():
    """A compile in another thread (the backward's, started by capture) keeps the collector
    off after capture's own pause ends; it comes back on when that one is done."""
    import gc
    import threading

    from torchweld import gc_pause

    started, release = threading.Event(), threading.Event()

    def backward_compile():
        with gc_pause.paused():
            started.set()
            release.wait(10)

    with gc_pause.paused():
        thread = threading.Thread(target=backward_compile)
        thread.start()
        started.wait(10)
    assert not gc.isenabled()  # capture is done, the other compile is not
    release.set()
    thread.join()
    assert gc.isenabled()


def test_reset_forgets_what_capture_remembered_and_compiles_again_correctly():
    """torchweld.reset() also drops resume code, decoded instructions, fake-run results and dtype
    answers; a function with a break compiles again from nothing and gives eager's results."""
    from torchweld import fake_memo
    from torchweld.capture import dtype_refusals, resume

    def fn(x, idx):
        y = torch.embedding(x, idx) * 2
        print("", end="")  # a break: a resume function
        return y.sum(0)

    compiled = torchweld.compile(fn, backend="eager")
    x, idx = torch.randn(5, 3), torch.tensor([0, 2])
    torch.testing.assert_close(compiled(x, idx), fn(x, idx))
    assert resume._make_resume_code.cache_info().currsize > 0 and dtype_refusals._REFUSES
    torchweld.reset()
    assert resume._make_resume_code.cache_info().currsize == 0 and not dtype_refusals._REFUSES
    assert not fake_memo._results
    torch.testing.assert_close(compiled(x, idx), fn(x, idx))


def test_reset_lets_a_compiled_models_memory_go():
    """After torchweld.reset(), nothing torchweld keeps holds a model a live compiled function was
    called with: dropping the model frees its memory without the cyclic GC, and the function
    compiles again for the next one."""
    import gc
    import weakref

    fn = torchweld.compile(lambda m, x: m(x))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    param = weakref.ref(model[0].weight)
    with torch.no_grad():
        fn(model, torch.randn(2, 64))
    gc.collect()  # what compiling left for the collector (as test_guards' dropped-model test)
    gc.disable()
    try:
        torchweld.reset()
        del model
        assert param() is None
    finally:
        gc.enable()
    assert fn(nn.Linear(3, 3), torch.randn(1, 3)).shape == (1, 3)  # still usable after reset
