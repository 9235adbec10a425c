"""Habits users bring from torch.compile (issue 48): copies and checkpoints of compiled
models, torch.compiler's controls, recompile messages, inputs weld cannot compile,
compile_times() as data, and validated options. Each compared with eager and, where it
has a meaning there too, with torch.compile."""
import contextlib
import copy
import io
import logging
import pickle

import pytest
import torch
import torch.nn as nn

import torchweld
from tests.capture.helpers import CountingBackend


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x))) * 2


def module_level_double(x):
    return x * 2


compiled_at_module_level = torchweld.compile(module_level_double, backend="eager")


@torchweld.compile(backend="eager")
def decorated_triple(x):
    return x * 3


@torchweld.register_backend("habits_counting")
def registered_counting(gm, example_inputs):
    return gm.forward


def saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# =============================================================================
# 1. copy.deepcopy, pickle and torch.save of compiled models
# =============================================================================


@pytest.mark.parametrize("copier", [copy.deepcopy, saved_and_loaded, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "torch.save", "pickle"])
def test_a_copied_compiled_module_compiles_anew_and_owns_its_parameters(copier):
    backend = CountingBackend()
    model = Block()
    compiled = torchweld.compile(model, backend=backend)
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), model(x))
    copied = copier(compiled)
    assert type(copied) is torchweld.CompiledModule
    assert copied._compiled_forward.cache_entries == []  # nothing compiled travels with it
    assert all(p is not q for p, q in zip(copied.parameters(), compiled.parameters()))
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(copied.parameters(), compiled.parameters()))
    assert list(copied.state_dict()) == list(compiled.state_dict())
    for y in (x, torch.randn(5, 4)):
        torch.testing.assert_close(copied(y), copied._orig_mod(y))
        torch.testing.assert_close(copied(y), model(y))
    with torch.no_grad():  # an EMA update of the copy leaves the original as it was
        for p in copied.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(copied(x), copied._orig_mod(x))
    assert not torch.allclose(copied(x), compiled(x))
    assert len(copied._compiled_forward.cache_entries) >= 1


def test_deepcopy_keeps_the_backend_object_and_copies_settings():
    backend = CountingBackend()
    options = {"k": 1}
    compiled = torchweld.compile(Block(), backend=backend, mode="max-autotune", options=options, fullgraph=True)
    copied = copy.deepcopy(compiled)
    request = copied._compiled_forward.request
    assert request.backend is backend and request.mode == "max-autotune" and request.fullgraph
    assert request.options == {"k": 1} and request.options is not compiled._compiled_forward.request.options
    x = torch.randn(2, 4)
    copied(x)
    assert len(backend.graphs) == 1  # the copy compiled, through the same backend


def test_a_compiled_submodule_is_copied_with_its_parent():
    parent = nn.Sequential(Block(), nn.Linear(4, 2))
    parent[0] = torchweld.compile(parent[0], backend="eager")
    x = torch.randn(3, 4)
    parent(x)
    copied = copy.deepcopy(parent)
    assert isinstance(copied[0], torchweld.CompiledModule)
    assert copied[0]._orig_mod is not parent[0]._orig_mod
    torch.testing.assert_close(copied(x), parent(x))
    loaded = saved_and_loaded(parent)
    torch.testing.assert_close(loaded(x), parent(x))


def test_a_compiled_function_copies_with_an_empty_cache():
    scale = 3.0

    def f(x):
        return torch.sin(x) * scale

    compiled = torchweld.compile(f, backend="eager")
    x = torch.randn(4)
    compiled(x)
    copied = copy.deepcopy(compiled)
    assert copied is not compiled and copied.cache_entries == [] and copied.__wrapped__ is f
    torch.testing.assert_close(copied(x), f(x))
    assert len(copied.cache_entries) == 1 and len(compiled.cache_entries) == 1


def test_a_decorated_function_pickles_by_name_and_a_compiled_one_with_its_function():
    x = torch.randn(2)
    decorated_triple(x)
    assert pickle.loads(pickle.dumps(decorated_triple)) is decorated_triple  # as a plain function does
    assert copy.deepcopy(decorated_triple) is decorated_triple
    compiled_at_module_level(x)
    loaded = pickle.loads(pickle.dumps(compiled_at_module_level))
    assert loaded is not compiled_at_module_level and loaded.__wrapped__ is module_level_double
    assert loaded.cache_entries == []
    torch.testing.assert_close(loaded(x), x * 2)


def test_a_registered_backend_pickles_by_name_and_a_local_one_is_named_in_the_error():
    loaded = saved_and_loaded(torchweld.compile(Block(), backend=registered_counting))
    assert loaded._compiled_forward.request.backend == "habits_counting"
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded(x), loaded._orig_mod(x))

    def my_local_backend(gm, example_inputs):
        return gm.forward

    compiled = torchweld.compile(Block(), backend=my_local_backend)
    with pytest.raises(pickle.PicklingError, match="cannot pickle the backend 'my_local_backend'.*register_backend"):
        pickle.dumps(compiled)
    copy.deepcopy(compiled)  # a deep copy keeps the backend as it is: no pickling needed


def test_a_copy_of_a_weld_compiled_module_matches_eager():
    model = Block().eval()
    compiled = torchweld.compile(model)
    x = torch.randn(8, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        for copied in (copy.deepcopy(compiled), saved_and_loaded(compiled)):
            for y in (x, torch.randn(2, 4)):  # the second shape fails a guard: compiled again
                torch.testing.assert_close(copied(y), model(y))


def test_torch_compile_module_copies_the_same_way():
    """The anchor: torch.compile's OptimizedModule deep-copies and saves with its parameters copied."""
    model = Block()
    for compiled in (torch.compile(model, backend="eager"), torchweld.compile(model, backend="eager")):
        copied = copy.deepcopy(compiled)
        assert type(copied) is type(compiled)
        assert all(p is not q for p, q in zip(copied.parameters(), model.parameters()))
        x = torch.randn(2, 4)
        torch.testing.assert_close(copied(x), model(x))
    torch._dynamo.reset()


# =============================================================================
# 6. options: validated, and never written
# =============================================================================


def test_an_unknown_option_is_an_error_naming_the_known_ones():
    with pytest.raises(torchweld.InvalidArgument,
                       match="unknown option 'fuse_atention' for backend 'weld'; known options: .*fuse_attention"):
        torchweld.compile(module_level_double, options={"fuse_atention": False})
    with pytest.raises(torchweld.InvalidArgument, match="unknown option 'freeze' for backend 'cudagraphs'"):
        torchweld.compile(module_level_double, backend="cudagraphs", options={"freeze": True})
    with pytest.raises(RuntimeError, match="Unexpected optimization option fuse_atention"):  # torch.compile's
        torch.compile(module_level_double, options={"fuse_atention": False})


def test_an_option_of_the_wrong_type_or_value_is_an_error():
    with pytest.raises(torchweld.InvalidArgument, match=r"options\['freeze'\] of backend 'weld' must be bool, got str"):
        torchweld.compile(module_level_double, options={"freeze": "yes"})
    with pytest.raises(torchweld.InvalidArgument, match=r"options\['cpu_codegen'\] .* one of 'cpp', 'triton', got 'c'"):
        torchweld.compile(module_level_double, options={"cpu_codegen": "c"})
    torchweld.compile(module_level_double, options={"freeze": True, "cpu_codegen": "cpp", "partition": "save_all"})


def test_a_callable_backend_takes_any_option():
    received = []

    def backend(gm, example_inputs, options=None):
        received.append(dict(options))
        return gm.forward

    torchweld.compile(module_level_double, backend=backend, options={"anything": 1})(torch.randn(2))
    assert received == [{"anything": 1}]


def test_the_users_options_are_never_written():
    options = {"cudagraph_outputs": "copy"}

    def f(x):
        y = x.sin()
        print("a break: two graphs")
        return y.cos()

    compiled = torchweld.compile(f, mode="reduce-overhead", options=options)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x.sin().cos())
    assert options == {"cudagraph_outputs": "copy"}
    backend_options = compiled._settings.backend.keywords["options"]
    assert backend_options is not options and list(backend_options.shared) == ["cudagraph_pool"]
    options["cudagraph_outputs"] = "track"  # a change after compile reaches no compiled model
    assert backend_options["cudagraph_outputs"] == "copy"


# =============================================================================
# 2. torch.compiler's controls
# =============================================================================


def sin_plus_one(x):
    return torch.sin(x) + 1


def both_compilers(fn):
    """(torchweld's counting backend, torchweld-compiled fn), (torch's, torch-compiled fn)."""
    ours, theirs = CountingBackend(), CountingBackend()
    return (ours, torchweld.compile(fn, backend=ours)), (theirs, torch.compile(fn, backend=theirs))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def both_stances(stance: str):
    """The stance for torchweld (torchweld.set_stance) and for torch.compile (torch.compiler's)."""
    with torchweld.set_stance(stance), torch.compiler.set_stance(stance):
        yield


def test_force_eager_runs_both_compilers_natively(fresh_dynamo):
    x = torch.randn(3)
    for backend, compiled in both_compilers(sin_plus_one):
        with both_stances("force_eager"):
            torch.testing.assert_close(compiled(x), sin_plus_one(x))
        assert backend.graphs == []
        compiled(x)
        assert len(backend.graphs) == 1
        with both_stances("force_eager"):  # a compiled entry is not used either
            torch.testing.assert_close(compiled(x), sin_plus_one(x))
    model = Block()
    compiled = torchweld.compile(model, backend=(backend := CountingBackend()))
    y = torch.randn(2, 4)
    with both_stances("force_eager"):
        torch.testing.assert_close(compiled(y), model(y))
    assert backend.graphs == []


def test_eager_on_recompile_keeps_what_was_compiled(fresh_dynamo):
    for backend, compiled in both_compilers(sin_plus_one):
        compiled(torch.randn(3))
        with both_stances("eager_on_recompile"):
            for x in (torch.randn(3), torch.randn(4, 2)):  # a hit, then a miss that runs eagerly
                torch.testing.assert_close(compiled(x), sin_plus_one(x))
        assert len(backend.graphs) == 1
        compiled(torch.randn(4, 2))  # default again: compiled
        assert len(backend.graphs) == 2


def test_fail_on_recompile_raises_with_the_failing_guard(fresh_dynamo):
    (ours, mine), (theirs, torchs) = both_compilers(sin_plus_one)
    for compiled in (mine, torchs):
        with both_stances("fail_on_recompile"), pytest.raises(RuntimeError, match="fail_on_recompile"):
            compiled(torch.randn(3))  # a first compile is refused too, as torch.compile refuses it
        compiled(torch.randn(3))
        with both_stances("fail_on_recompile"):
            compiled(torch.randn(3))  # a hit is fine
            with pytest.raises(RuntimeError, match="fail_on_recompile") as raised:
                compiled(torch.randn(5))
        if compiled is mine:
            assert "guard failed: L['x'].shape == (3,) (got (5,))" in str(raised.value)
            assert __file__ in str(raised.value)
    assert len(ours.graphs) == len(theirs.graphs) == 1


def test_eager_then_compile_runs_the_first_call_eagerly(fresh_dynamo):
    for backend, compiled in both_compilers(sin_plus_one):
        with both_stances("eager_then_compile"):
            compiled(torch.randn(3))
            assert backend.graphs == []
            compiled(torch.randn(3))
        assert len(backend.graphs) == 1


def test_set_stance_as_a_call_a_with_and_a_decorator():
    """As torch.compiler.set_stance: a call sets it from now on, `with` restores it after, and as a
    decorator it holds only inside the function's calls (decorating changes nothing)."""
    from torchweld.torch_controls import stance

    @torchweld.set_stance("force_eager")
    def eager_inside():
        return stance()

    assert stance() == "default"
    assert eager_inside() == "force_eager" and eager_inside() == "force_eager"
    assert stance() == "default"
    with torchweld.set_stance("fail_on_recompile"):
        assert stance() == "fail_on_recompile" and eager_inside() == "force_eager"
        assert stance() == "fail_on_recompile"
    assert stance() == "default"
    torchweld.set_stance("eager_on_recompile")
    try:
        assert stance() == "eager_on_recompile"
    finally:
        torchweld.set_stance("default")
    assert stance() == "default"


def helper_in_graph(x, scale):
    return torch.cos(x) * scale


def uses_allowed(x):
    return helper_in_graph(x + 1, 2.0) - 1


def test_allow_in_graph_makes_one_graph_node(fresh_dynamo):
    torchweld.allow_in_graph(helper_in_graph)
    torch.compiler.allow_in_graph(helper_in_graph)
    try:
        x = torch.randn(4)
        for backend, compiled in both_compilers(uses_allowed):
            torch.testing.assert_close(compiled(x), uses_allowed(x))
            targets = [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
            assert helper_in_graph in targets, targets
        torch.testing.assert_close(torchweld.compile(uses_allowed)(x), uses_allowed(x))  # weld traces through it
    finally:
        torch._dynamo.disallow_in_graph(helper_in_graph)
        del helper_in_graph._torchweld_allow_in_graph
    backend = CountingBackend()
    torchweld.compile(uses_allowed, backend=backend)(torch.randn(4))
    targets = [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
    assert helper_in_graph not in targets  # no longer marked: inlined


SETTING = {"scale": 3.0}


@torch.compiler.assume_constant_result
def configured_scale():
    return SETTING["scale"]


def scaled(x):
    return x * configured_scale()


def test_assume_constant_result_is_a_constant_of_the_graph(fresh_dynamo):
    x = torch.randn(4)
    for backend, compiled in both_compilers(scaled):
        torch.testing.assert_close(compiled(x), x * 3.0)
        assert not any(n.target is configured_scale for n in backend.graphs[0].graph.nodes)
        SETTING["scale"] = 5.0  # the promise broken: both compilers keep the answer they assumed
        try:
            torch.testing.assert_close(compiled(x), x * 3.0)
        finally:
            SETTING["scale"] = 3.0


def breaks_in_the_middle(x):
    y = torch.sin(x)
    torchweld.graph_break()
    return torch.cos(y)


def breaks_in_the_middle_for_torch(x):
    y = torch.sin(x)
    torch._dynamo.graph_break()
    return torch.cos(y)


def test_graph_break_in_user_code_breaks_the_graph(fresh_dynamo):
    """torchweld.graph_break() breaks torchweld's graph as torch._dynamo.graph_break() breaks torch.compile's."""
    x = torch.randn(4)
    (ours, mine), _ = both_compilers(breaks_in_the_middle)
    _, (theirs, torchs) = both_compilers(breaks_in_the_middle_for_torch)
    for backend, compiled in ((ours, mine), (theirs, torchs)):
        torch.testing.assert_close(compiled(x), breaks_in_the_middle(x))
        assert len(backend.graphs) == 2
    torch.testing.assert_close(breaks_in_the_middle(x), torch.cos(torch.sin(x)))  # a no-op outside compiled code
    report = torchweld.explain(breaks_in_the_middle)(x)
    assert report.graph_break_count == 1
    assert "graph_break() asks for a graph break here" in str(report)


def test_torch_compiler_reset_leaves_torchweld_alone_and_torchweld_reset_clears_it():
    compiled = torchweld.compile(sin_plus_one, backend="eager")
    compiled(torch.randn(2))
    torch.compiler.reset()  # torch's caches only: torch has no hook torchweld could follow
    assert len(compiled.cache_entries) == 1
    torchweld.reset()
    assert compiled.cache_entries == []


def test_torch_logs_maps_onto_torchweld_artifacts():
    from torchweld import logs

    assert logs.from_torch_logs("+dynamo,graph_breaks,recompiles_verbose,-guards,output_code") == \
        "graph_breaks,+recompiles,output_code"
    with torchweld.config.patch(logs=None, torch_logs="graph_breaks,+inductor"):
        assert logging.getLogger("torchweld.graph_breaks").isEnabledFor(logging.INFO)
        assert not logging.getLogger("torchweld.guards").isEnabledFor(logging.INFO)
    with torchweld.config.patch(logs="", torch_logs="graph_breaks"):  # TORCHWELD_LOGS set: it alone counts
        assert not logging.getLogger("torchweld.graph_breaks").isEnabledFor(logging.INFO)


def test_torch_logs_in_the_environment(tmp_path):
    import subprocess
    import sys

    script = ("import torch, torchweld\n"
              "def f(x):\n    y = x + 1\n    print('out')\n    return y * 2\n"
              "torchweld.compile(f, backend='eager')(torch.randn(2))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCHWELD_LOGS"}
    env["TORCH_LOGS"] = "graph_breaks"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "[torchweld torchweld.graph_breaks]" in done.stderr and "print" in done.stderr


# =============================================================================
# 4. what weld cannot compile runs eagerly, with a reason
# =============================================================================


def plus_imaginary(a):
    return a * a + 1j


@pytest.mark.parametrize("fn,make", [
    (plus_imaginary, lambda: torch.randn(5)),
    (lambda z: z * z + 1, lambda: torch.randn(5, dtype=torch.complex64)),
    (lambda x: torch.fft.fft(x).abs(), lambda: torch.randn(8)),
], ids=["complex constant", "complex input", "complex intermediate"])
def test_complex_values_run_with_a_log_line(fn, make, caplog):
    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        compiled = torchweld.compile(fn)
        for x in (make(), make()):
            torch.testing.assert_close(compiled(x), fn(x))
    assert any("complex" in r.getMessage() and "runs as captured" in r.getMessage() for r in caplog.records)


def test_complex_constant_in_training():
    a = torch.randn(3, requires_grad=True)
    torchweld.compile(lambda a: (a * a + 1j).real.sum())(a).backward()
    torch.testing.assert_close(a.grad, 2 * a.detach())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_sparse_inputs_run_with_a_log_line(layout, caplog):
    def scaled_product(a, b):
        return (a @ b).relu() * 2

    def sparse():
        dense = torch.randn(4, 4) * (torch.rand(4, 4) > 0.5)
        return dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()

    with caplog.at_level(logging.WARNING, logger="torchweld.weld"):
        for backend in ("weld", "eager"):
            compiled = torchweld.compile(scaled_product, backend=backend)
            for a in (sparse(), sparse()):
                b = torch.randn(4, 3)
                torch.testing.assert_close(compiled(a, b), scaled_product(a, b))
    if layout == "csr":  # captured, and run by weld as captured
        assert any("a tensor of layout torch.sparse_csr" in r.getMessage() for r in caplog.records)
    else:  # not captured: the frame runs eagerly
        assert "only dense torch.Tensor inputs are captured" in str(torchweld.explain(scaled_product)(sparse(), b))
    double = torchweld.compile(lambda a: a * 2)
    a = sparse()
    torch.testing.assert_close(double(a).to_dense(), a.to_dense() * 2)


class WithTorchCompiledPart(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), backend="eager")
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.inner(x) + 1).sum()


def test_a_torch_compiled_submodule_runs_as_it_is(fresh_dynamo):
    model = WithTorchCompiledPart()
    backend = CountingBackend()
    compiled = torchweld.compile(model, backend=backend)
    x = torch.randn(3, 4)
    compiled(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).backward()
    for got, expected in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected)
    assert all(not any(isinstance(m, type(model.inner)) for m in g.modules()) for g in backend.graphs)
    report = torchweld.explain(WithTorchCompiledPart())(x)
    assert report.graph_break_count == 1
    assert "module Sequential was compiled with torch.compile: it runs as it is" in str(report)
    weld = torchweld.compile(model)
    torch.testing.assert_close(weld(x), model(x))


# =============================================================================
# 5. compile_times() as data, the passes as functions
# =============================================================================


def test_compile_times_is_data_and_a_table_on_request():
    from torchweld import timing

    timing.reset()
    assert torchweld.compile_times() == {}
    torchweld.compile(sin_plus_one, backend="eager")(torch.randn(3))
    times = torchweld.compile_times()
    assert isinstance(times, dict) and "capture" in times and all(isinstance(s, float) for s in times.values())
    table = torchweld.compile_times("str")
    assert table.splitlines()[0].split() == ["phase", "calls", "seconds"] and "capture" in table
    phases, seconds = torchweld.compile_times(repr="csv", aggregate=True)  # torch's csv form
    assert phases == list(times) and [float(s) for s in seconds] == pytest.approx(list(times.values()), abs=1e-5)
    from torch._dynamo.utils import compile_times as torch_compile_times

    headers, values = torch_compile_times(repr="csv", aggregate=True)
    assert isinstance(headers, list) and isinstance(values, list)  # the same shape of answer
    with pytest.raises(ValueError, match="repr must be"):
        torchweld.compile_times("json")


def test_fuse_conv_bn_is_the_pass():
    from torchweld.passes import fuse_conv_bn

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    folded = fuse_conv_bn(model)
    called = [folded.get_submodule(n.target) for n in folded.graph.nodes if n.op == "call_module"]
    assert [type(m) for m in called] == [nn.Conv2d, nn.ReLU]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-5)


# =============================================================================
# 3. recompile messages show what was found; argument errors name the user's function
# =============================================================================


def recompile_messages(fn, calls, caplog) -> list[str]:
    with torchweld.config.patch(logs="recompiles"), caplog.at_level(logging.INFO, logger="torchweld"):
        for args in calls:
            fn(*args)
    return [r.getMessage() for r in caplog.records if r.name == "torchweld.recompiles"]


def test_recompile_messages_show_the_value_found(caplog):
    def scale(x, k, flag):
        return x * k if flag else x

    compiled = torchweld.compile(scale, backend="eager")
    x = torch.randn(4)
    calls = [(x, 3, True), (torch.randn(8), 3, True), (x.double(), 3, True), (x, 4, True), (x, 3.0, True),
             (x, 3, False)]
    messages = recompile_messages(compiled, calls, caplog)
    assert "guard failed: L['x'].shape == (4,) (got (8,))" in messages[0]
    assert "guard failed: L['x'].dtype == torch.float32 (got torch.float64)" in messages[1]
    assert "guard failed: L['k'] == 3 (got 4)" in messages[2]
    assert "guard failed: L['k'] == 3 (got float)" in messages[3]
    assert "guard failed: L['flag'] is True (got False)" in messages[4]


def test_recompile_messages_for_modules_and_grad_mode(caplog):
    model = Block()
    compiled = torchweld.compile(model, backend="eager")
    x = torch.randn(2, 4)
    with torchweld.config.patch(logs="recompiles"), caplog.at_level(logging.INFO, logger="torchweld"):
        compiled(x)
        model.lin = nn.Linear(4, 4)
        compiled(x)
        model.eval()
        compiled(x)
        with torch.no_grad():
            compiled(x)
    messages = [r.getMessage() for r in caplog.records if r.name == "torchweld.recompiles"]
    assert "L['self'].lin is <Linear object at" in messages[0] and "(got <Linear object at" in messages[0]
    assert "L['self'].lin.training is True (got False)" in messages[1]
    assert "torch.is_grad_enabled() is True (got False)" in messages[2]


def test_the_cache_size_limit_warning_points_at_the_users_line_for_a_module():
    compiled = torchweld.compile(Block(), backend="eager")
    with torchweld.config.patch(cache_size_limit=1):
        compiled(torch.randn(2, 4))
        with pytest.warns(UserWarning, match=r"L\['x'\]\.shape == \(2, 4\) \(got \(3, 4\)\)") as caught:
            compiled(torch.randn(3, 4))
    assert caught[0].filename == __file__


def eager_error(fn, *args, **kwargs) -> str:
    with pytest.raises(TypeError) as raised:
        fn(*args, **kwargs)
    return str(raised.value)


def test_argument_errors_name_the_users_function():
    def two(a, b):
        return a + b

    class Model(nn.Module):
        def forward(self, x):
            return x + 1

    x = torch.randn(2)
    model = Model()
    compiled, module = torchweld.compile(two, backend="eager"), torchweld.compile(model, backend="eager")
    for attempt in range(2):  # before any entry exists, then through a compiled entry
        for args, kwargs in (((x, x, x), {}), ((x,), {}), ((x, x), {"c": 1})):
            expected = eager_error(two, *args, **kwargs)
            assert expected.startswith("test_argument_errors_name_the_users_function.<locals>.two() ")
            assert eager_error(compiled, *args, **kwargs) == expected
        assert eager_error(module, x, x) == eager_error(model, x, x) == \
            "test_argument_errors_name_the_users_function.<locals>.Model.forward() takes 2 positional arguments but 3 were given"
        compiled(x, x), module(x)
