"""Habits users bring from torch.compile (issue 48): copies and checkpoints of compiled
models, torch.compiler's controls, recompile messages, inputs weld cannot compile,
compile_times() as data, and validated options. Each compared with eager and, where it
has a meaning there too, with torch.compile."""
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
