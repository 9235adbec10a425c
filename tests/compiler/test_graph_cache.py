"""The graph cache (torchweld/compiler/graph_cache.py): a second process compiling the same
graph loads it instead of lowering it, and computes what eager computes, with its own
weights; anything the code depends on (a module's setting, an input's shape or dtype, a
constant made in the frame) is another entry; a damaged entry is compiled again with a
warning. Each process is a fresh one (graph_cache_run.py) sharing one cache directory."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from torchweld.compiler import graph_cache

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_cache_run.py")


def run(cache: str, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, TORCHWELD_CACHE_DIR=cache, TORCHWELD_GRAPH_CACHE="1", TORCHWELD_COMPILE_WORKERS="0")
    proc = subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("case", ["mlp", "train", "triton", "step"])
def test_a_second_process_loads_the_graph_and_computes_what_eager_does(tmp_path, case):
    cache = str(tmp_path)
    first, _ = run(cache, "--case", case)
    assert not first["loaded"] and first["lowered"] and first["max_diff"] < 1e-5, first
    entries = glob.glob(os.path.join(cache, "graphs", "*.json"))
    # training: the forward, the backward and the training entry naming them (the trace's and
    # partition's decisions); a whole step: those, and the optimizer's update
    assert len(entries) == {"train": 3, "step": 4}.get(case, 1), entries
    # other weights: read by the loaded graph when it runs, not baked into it
    second, _ = run(cache, "--case", case, "--seed", "1")
    assert second["loaded"] and not second["lowered"] and second["max_diff"] < 1e-5, second
    assert not second["traced"], second  # training: no joint trace, no partition


def test_a_graph_keyed_before_the_fx_passes_is_loaded_without_running_them(tmp_path):
    """An inference graph's key is the captured graph (compiler/driver.compile_graph's `prepare`):
    a second process loads it and skips the passes (channels-last convolution, attention
    fusion), and computes what eager does, a weight changed in place and an attribute changed
    (a recompile) included."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "passes")
    # two graphs (the attribute's change is a recompile), each through the passes
    assert first["lowered"] and first["pass_runs"] == 2 and first["max_diff"] < 1e-4, first
    second, _ = run(cache, "--case", "passes", "--seed", "1")
    assert second["loaded"] and not second["lowered"] and second["pass_runs"] == 0, second
    assert second["max_diff"] < 1e-4, second


def test_dropout_in_a_loaded_training_graph_draws_anew_at_each_call(tmp_path):
    """A training graph with random draws (and the empty tensors its trace makes) is kept
    whole; loaded, its masks still change from call to call and its gradients follow them."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "dropout")
    second, _ = run(cache, "--case", "dropout", "--seed", "1")
    assert first["max_diff"] < 1e-5 and second["max_diff"] < 1e-5, (first, second)
    assert second["loaded"] and not second["traced"], second


def test_a_graph_over_symbols_is_loaded_where_its_guards_hold(tmp_path):
    """A graph compiled over symbolic sizes is kept under its symbols, not its sizes: a second
    process with other lengths loads it, and assumes what its compile assumed (here 32-bit
    indices, for at most 4096 elements); one whose first length breaks that compiles again."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "symbolic", "--lengths", "5,9")
    other_lengths, _ = run(cache, "--case", "symbolic", "--lengths", "17,6,300")
    assert first["lowered"] and not other_lengths["lowered"], (first, other_lengths)
    past_the_guard, _ = run(cache, "--case", "symbolic", "--lengths", "2000,3000,2000")
    assert past_the_guard["lowered"], past_the_guard
    for result in (first, other_lengths, past_the_guard):
        assert result["max_diff"] < 1e-4, result


def test_a_training_step_over_symbols_is_loaded_whole_at_other_lengths(tmp_path):
    """A training step compiled over symbols is kept whole under its symbols (its forward, its
    backward, and the training entry naming them): a second process, at other lengths, neither
    traces the joint graph nor lowers, and its gradients equal eager's (its backward reads the
    batch, which no saved tensor holds alone)."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "symbolic_train", "--lengths", "5,9")
    assert len(glob.glob(os.path.join(cache, "graphs", "*.json"))) == 3
    second, _ = run(cache, "--case", "symbolic_train", "--lengths", "12,7,20", "--seed", "1")
    assert first["lowered"] and first["traced"], first
    assert second["loaded"] and not second["lowered"] and not second["traced"], second
    assert first["max_diff"] < 1e-5 and second["max_diff"] < 1e-5, (first, second)


def test_a_training_entry_over_symbols_whose_guards_fail_is_traced_again(tmp_path):
    """What a training step's compile over symbols assumed (here its Triton kernels' 32-bit
    indices, for at most 1024 elements) is kept with it: a later process that loads it still
    checks it, at its own lengths; one whose first length breaks it traces and compiles again,
    and both compute eager's gradients."""
    cache = str(tmp_path)
    triton = ("--case", "symbolic_train", "--triton-int32-limit", "1024")
    first, _ = run(cache, *triton, "--lengths", "5,9")
    loaded, _ = run(cache, *triton, "--lengths", "12,7,40", "--seed", "1")  # 40: past the guard, per size
    assert loaded["loaded"] and not loaded["traced"], loaded
    past_the_guard, _ = run(cache, *triton, "--lengths", "50,9", "--seed", "2")
    assert past_the_guard["traced"] and past_the_guard["lowered"], past_the_guard
    for result in (first, loaded, past_the_guard):
        assert result["max_diff"] < 1e-5, result


def test_a_modules_empty_buffer_returned_by_a_loaded_graph_is_that_buffer(tmp_path):
    """A loaded graph's outputs alias the module as eager's do: a module's own empty buffer,
    returned, is that very object (empty constants the trace makes are kept by value; a
    module's own stay bound by attribute path)."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "empty_buffer")
    second, _ = run(cache, "--case", "empty_buffer")
    assert first["max_diff"] == 0 and second["max_diff"] == 0 and second["loaded"], (first, second)


def test_a_parameter_frozen_since_is_another_training_entry(tmp_path):
    """Which tensors require grad decides the joint graph: a frozen weight is another entry."""
    cache = str(tmp_path)
    run(cache, "--case", "train")
    frozen, _ = run(cache, "--case", "train", "--frozen")
    assert frozen["traced"] and frozen["max_diff"] < 1e-5, frozen
    again, _ = run(cache, "--case", "train", "--frozen", "--seed", "2")
    assert not again["traced"] and not again["lowered"] and again["max_diff"] < 1e-5, again


def test_a_backward_whose_inputs_are_laid_out_otherwise_is_traced_again(tmp_path):
    """The forward loads from the training entry; the first backward's inputs, unlike the
    layouts the entry's backward was compiled for, make the step trace and partition again."""
    cache = str(tmp_path)
    run(cache, "--case", "train")
    other, _ = run(cache, "--case", "train", "--seed", "1", "--other-backward-layouts")
    assert other["loaded"] and other["traced"] and other["max_diff"] < 1e-5, other


@pytest.mark.parametrize("changed", [["--eps", "1e-3"], ["--batch", "5"], ["--dtype", "float64"]])
def test_what_the_code_depends_on_is_another_entry(tmp_path, changed):
    cache = str(tmp_path)
    run(cache)
    again, _ = run(cache, *changed)
    assert not again["loaded"] and again["lowered"] and again["max_diff"] < 1e-5, again
    assert len(glob.glob(os.path.join(cache, "graphs", "*.json"))) == 2


def test_state_changed_under_a_loaded_graph(tmp_path):
    """A loaded graph reads a weight changed in place after it ran, and a changed LayerNorm eps
    fails its guard and compiles (or loads) the graph of the new setting, as eager computes."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "state")
    assert not first["loaded"] and first["max_diff"] < 1e-5, first
    assert len(glob.glob(os.path.join(cache, "graphs", "*.json"))) == 2  # eps as it was, and 0.5
    second, _ = run(cache, "--case", "state", "--seed", "1")
    assert second["loaded"] and not second["lowered"] and second["max_diff"] < 1e-5, second


def test_a_tensor_made_in_the_frame_with_other_values_is_another_entry(tmp_path):
    """Its values are literals of the graph's nodes (in the key); the trace's constant made
    from them is kept by value in the entry, and a third process loads it."""
    cache = str(tmp_path)
    first, _ = run(cache, "--case", "frame_constant", "--scale", "2.0")
    second, _ = run(cache, "--case", "frame_constant", "--scale", "-7.0")
    assert not second["loaded"] and first["max_diff"] < 1e-5 and second["max_diff"] < 1e-5, (first, second)
    third, _ = run(cache, "--case", "frame_constant", "--scale", "-7.0")
    assert third["loaded"] and third["max_diff"] < 1e-5, third


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_entry_is_compiled_again_with_a_warning(tmp_path, damage):
    cache = str(tmp_path)
    run(cache)
    (entry,) = glob.glob(os.path.join(cache, "graphs", "*.json"))
    with open(entry, "rb") as f:
        data = f.read()
    with open(entry, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"{" + os.urandom(200))
    again, stderr = run(cache)
    assert not again["loaded"] and again["lowered"] and again["max_diff"] < 1e-5, again
    assert "is damaged" in stderr and "compiling it again" in stderr, stderr[-2000:]
    third, _ = run(cache)  # written anew by the second process
    assert third["loaded"] and third["max_diff"] < 1e-5, third


def test_the_key_refuses_what_its_name_does_not_fix():
    """A user's function in the graph, or a tensor subclass, is not kept (its code may change
    between processes under the same name); torch's and Python's operators are named."""
    assert graph_cache._callable_name(torch.ops.aten.mm.default) == "op:aten.mm.default"
    assert graph_cache._resolve(graph_cache._callable_name(torch.nn.functional.relu)) is torch.nn.functional.relu
    assert graph_cache._resolve(graph_cache._callable_name(torch.ops.aten.add.Tensor)) is torch.ops.aten.add.Tensor
    assert graph_cache._resolve(graph_cache._callable_name(torch.Tensor.add)) == torch.Tensor.add  # a C method
    with pytest.raises(graph_cache.NotKept):
        graph_cache._callable_name(lambda x: x)

    def user_function(x):
        return x

    with pytest.raises(graph_cache.NotKept):
        graph_cache._callable_name(user_function)
    with pytest.raises(graph_cache.NotKept):
        graph_cache._Describer().tensor(torch.ones(2).to_sparse())


def test_torchwelds_own_operators_are_found_in_a_new_process():
    """An entry may call torch.ops.torchweld.* (GPT-2's backward on CUDA calls the embedding
    backward); a new process has them once the module defining each is imported: the GPU
    run's backward was compiled again at every warm start before."""
    code = ("from torchweld.compiler import graph_cache\n"
            "for op in ('embedding_dense_backward', 'seeded_rand', 'decode_attention', 'matvec', 'attention'):\n"
            "    print(graph_cache._resolve(f'op:torchweld.{op}.default'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("torchweld.") == 5, proc.stderr[-2000:]


def test_freeze_and_max_autotune_are_not_kept(monkeypatch):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    monkeypatch.setattr("torchweld.config.graph_cache", True)
    assert graph_cache.graph_key(gm, [torch.ones(1, 2)], {}, False, None, False) is not None
    for options in ({"freeze": True}, {"max_autotune": True}):
        assert graph_cache.graph_key(gm, [torch.ones(1, 2)], options, False, None, False) is None


def test_a_wrapped_operator_has_a_recipe():
    """A CUDA training step's backward calls convolution_backward through lowering's wrapper
    for its None results: the backward was not kept (compiled again at every warm start)."""
    from torchweld.compiler.lowering import _NonTensorsAsEmpty

    wrapped = _NonTensorsAsEmpty(torch.ops.aten.convolution_backward.default)
    recipe = graph_cache._callable_recipe(wrapped)
    assert json.loads(json.dumps(recipe)) == recipe
    assert graph_cache._callable_from(recipe) == wrapped


def test_a_fast_launch_over_symbols_is_kept_as_the_python_that_computes_its_sizes():
    """A CUDA kernel's fast launch over symbols has a grid and int arguments that are SymInts: the
    entry keeps the Python the wrapper computes them with (JSON has no SymInt: the compile over
    symbols failed at its store and went per size on the H200), and a load renders them alike."""
    import types

    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from torchweld.capture.symbolic_sizes import SizeSource
    from torchweld.compiler.symbols import size_text

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(300, SizeSource("x", 1), dynamic_dim=DimDynamic.DYNAMIC), hint=300)
    job = types.SimpleNamespace(arg_dtypes=(torch.float32,), aligned=(True,), config=(("XBLOCK", 128),),
                                device=torch.device("cuda", 0), ints=(), params=(), unspecialized=())
    part = types.SimpleNamespace(job=job, grid=(s * 768 + 127) // 128, args=("arg1",), ints=(s * 768, 768))
    entry = json.loads(json.dumps(graph_cache._fast_part(part, "k_0")))
    grid, ints = graph_cache._size_from(entry["grid"]), [graph_cache._size_from(v) for v in entry["ints"]]
    assert size_text(grid) == size_text(part.grid) and [size_text(v) for v in ints] == list(map(size_text, part.ints))
    assert ints[1] == 768 and ints[0] != 1  # a constant stays an int; a symbolic size is never Triton's constant 1
    # the grid codegen writes over symbols (triton_launches._grid: Python text, not sympy's floor division)
    from torchweld.compiler.codegen.triton_launches import _grid

    written = _grid(types.SimpleNamespace(outer=(8, s)), 128)
    entry = json.loads(json.dumps(graph_cache._fast_part(types.SimpleNamespace(**{**vars(part), "grid": written}), "k_0")))
    loaded = graph_cache._size_from(entry["grid"])
    assert size_text(loaded) == size_text(written) == written
    for n in (1, 300, 977):
        assert eval(written, {str(s.node.expr): n}) == -(-8 * n // 128)
    assert _grid(types.SimpleNamespace(outer=(8, 300)), 128) == 19


def test_an_entry_that_cannot_be_written_leaves_the_compile_be(tmp_path, monkeypatch, caplog):
    """A value the entry cannot hold (here the outputs' spec) is a warning and an entry not kept,
    never a failed compile: the graph runs, compiled, as eager's."""
    import logging

    import torchweld

    monkeypatch.setattr(graph_cache.pytree, "treespec_dumps", lambda spec: object())
    fn = torchweld.compile(lambda x: (x * 2).relu() + 1, backend="weld")
    x = torch.randn(5, 7)
    with torchweld.config.patch(cache_dir=str(tmp_path), graph_cache=True), caplog.at_level(logging.WARNING):
        torch.testing.assert_close(fn(x), (x * 2).relu() + 1)
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    assert not glob.glob(os.path.join(str(tmp_path), "graphs", "*.json"))
