"""Dynamic shapes (issue 45): symbolic sizes in capture, the guards on their relations, the
three `dynamic=` modes, marks, and torch.compile's graph counts and dynamic dims as the anchor."""
from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F

import torchweld
from torchweld.errors import DynamicDimSpecialized
from tests import models
from tests.capture.helpers import CountingBackend, assert_same

SIZES = [6, 9, 7, 13, 10, 17, 11, 14, 15, 18]  # none equal to another dim of the inputs (duck sizing)


def _symbolic_dims(gm) -> list[tuple[int, ...]]:
    """Which dims of each argument (not parameters, which torch.compile lifts as inputs) are symbolic."""
    dims = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and node.name in ("l_x_", "l_y_"):
            dims.append(tuple(d for d, n in enumerate(value.shape) if isinstance(n, torch.SymInt)))
    return dims


def _torch_compile(fn, calls, dynamic):
    """(graph count, symbolic dims of each graph's tensor inputs) under torch.compile."""
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    for args in calls:
        compiled(*args)
    torch._dynamo.reset()
    return len(backend.graphs), [_symbolic_dims(g) for g in backend.graphs]


def _torchweld(fn, calls, dynamic):
    backend = CountingBackend()
    compiled = torchweld.compile(fn, backend=backend, dynamic=dynamic)
    for args in calls:
        assert_same(compiled(*args), fn(*args))
    return len(backend.graphs), [_symbolic_dims(g) for g in backend.graphs]


# -- programs: each takes the size that varies ------------------------------------

def views(x):
    return x.view(x.shape[0], -1).sum(1) + x.reshape(-1, x.size(-1)).mean()


def arange_by_size(x):
    return x + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1) / x.shape[0]


def slicing_by_sizes(x):
    half = x.shape[0] // 2
    return x[:half] * 2 - x[x.shape[0] - half:], x[:, 1:].sum()


def reductions(x):
    return x.sum(0), x.amax(1), x.softmax(-1) * x.size(-1) ** 0.5, x.numel() * x.mean()


def concatenation(x, y):
    return torch.cat([x, y, x * 2], dim=0).relu(), torch.stack([x, y]).sum(0)


def shape_tuples(x):  # GPT-2's `(-1,) + input_shape[1:] + (hidden.size(-1),)`; a list spelling too
    out_shape = (-1,) + x.shape[1:-1] + (x.size(-1),)
    return x.view(out_shape) * 2, x.view([-1] + [x.size(-1)]).sum(0)


POSITIONS = torch.arange(64).view(1, -1)


def integer_buffer_sliced(x):  # BERT's `self.position_ids[:, 0 : seq_length + 0]`: an int64 tensor
    return x + POSITIONS[:, 0 : x.shape[1] + 0].unsqueeze(-1)


def int_argument(x, n):  # a count passed in: slices, a factory, arithmetic, float(), an output
    return x[:, :n] * n + torch.arange(n, dtype=x.dtype) / float(n or 1), n * 2, float(n), int(n)


def branch_on_int(x, k):  # a branch on the int: one symbolic version a side
    if k > 3:
        return x * k
    return x - k


def size_across_a_break(x):  # the size a resume function receives as a local
    n = x.shape[0]
    y = x.sin()
    print(end="")  # a graph break
    return y.view(n, -1) + n


def Block():  # noqa: N802 - the models' transformer block, causal, small
    return models.Block(d=16, heads=2, causal=True)


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, stride=2)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _calls(name):
    torch.manual_seed(0)
    if name == "views":
        return views, [(torch.randn(n, 3, 4),) for n in SIZES]
    if name == "arange":
        return arange_by_size, [(torch.randn(n, 5),) for n in SIZES]
    if name == "slicing":
        return slicing_by_sizes, [(torch.randn(n, 4),) for n in SIZES]
    if name == "reductions":
        return reductions, [(torch.randn(3, n),) for n in SIZES]
    if name == "cat":
        return concatenation, [(torch.randn(n, 4), torch.randn(n, 4)) for n in SIZES]
    if name == "transformer":
        return Block().eval(), [(torch.randn(2, n, 16),) for n in SIZES]
    if name == "int argument":
        return int_argument, [(torch.randn(3, 20), n) for n in (4, 5, 7, 9, 12, 1, 0)]
    if name == "int branch":
        return branch_on_int, [(torch.randn(3), k) for k in (2, 5, 7, 1, 3, 9, -4)]
    if name == "size across a break":
        return size_across_a_break, [(torch.randn(n, 6),) for n in SIZES]
    if name == "shape tuples":
        return shape_tuples, [(torch.randn(2, n, 4),) for n in SIZES]
    if name == "int slice":
        return integer_buffer_sliced, [(torch.randn(2, n, 3),) for n in SIZES]
    if name == "cnn":
        return SmallCNN().eval(), [(torch.randn(n, 3, 12, 12),) for n in SIZES]
    raise KeyError(name)


PROGRAMS = ["views", "arange", "slicing", "reductions", "cat", "transformer", "shape tuples", "int slice",
            "int argument", "int branch", "size across a break", "cnn"]


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("dynamic", [None, True])
def test_graph_counts_and_dynamic_dims_match_torch_compile(name, dynamic):
    fn, calls = _calls(name)
    ours = _torchweld(fn, calls, dynamic)
    theirs = _torch_compile(fn, calls, dynamic)
    assert ours == theirs
    if name not in ("cnn", "int argument", "int branch", "size across a break"):  # the convolution's meta function
        # picks its algorithm by batch (< 16 or not); slicing and arange by an int of 0 or 1 specialize; a branch
        # compiles a version a side; a break is two functions: more versions, as many as torch.compile's
        assert ours[0] <= (2 if dynamic is None else 1)


@pytest.mark.parametrize("name", ["views", "transformer"])
def test_dynamic_false_compiles_every_size(name):
    fn, calls = _calls(name)
    with torchweld.config.patch(cache_size_limit=16):
        count, dims = _torchweld(fn, calls, False)
    assert count == len(SIZES) and all(d == () for graph in dims for d in graph)


def test_ten_sizes_compile_twice_then_never_again():
    backend = CountingBackend()
    fn = torchweld.compile(views, backend=backend)
    for n in SIZES + SIZES[::-1]:
        x = torch.randn(n, 3, 4)
        assert_same(fn(x), views(x))
    assert len(backend.graphs) == 2
    assert _symbolic_dims(backend.graphs[0]) == [()] and _symbolic_dims(backend.graphs[1]) == [(0,)]


def test_sizes_zero_and_one_specialize():
    def f(x):
        return x * 2 + x.shape[0], x.sum(0)

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (5, 1, 6, 0, 1, 7):
        x = torch.randn(n, 3, 4)
        assert_same(fn(x), f(x))
    shapes = [[tuple(n.meta["example_value"].shape) for n in g.graph.nodes if n.op == "placeholder"][0]
              for g in backend.graphs]
    assert len(backend.graphs) == 3
    assert str(shapes[1][0]) == "1" and str(shapes[2][0]) == "0"
    assert isinstance(shapes[0][0], torch.SymInt)


def test_branch_on_a_size_guards_the_branch_taken():
    def f(x):
        if x.shape[0] > 4:
            return x * 2
        return x - 1

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (6, 3, 8, 2, 5, 4):
        x = torch.randn(n)
        assert_same(fn(x), f(x))
    assert len(backend.graphs) == 2


def test_relation_between_two_inputs_is_guarded():
    def f(x, y):
        return x + y  # assumes x.shape[0] == y.shape[0] (or one of them 1)

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for a, b in ((4, 4), (6, 6), (5, 1), (7, 7), (3, 1)):
        x, y = torch.randn(a, 2), torch.randn(b, 2)
        assert_same(fn(x, y), f(x, y))
    assert len(backend.graphs) == 2
    guards = "\n".join(fn.cache_entries[0].report.guards)
    assert "L['y'].size()[0] == s" in guards or "L['x'].size()[0] == s" in guards
    with pytest.raises(RuntimeError):  # unequal sizes: the guard fails, and eager's error is raised
        fn(torch.randn(4, 2), torch.randn(6, 2))


def test_sizes_read_through_python_stay_symbolic_and_come_back_as_ints():
    def f(x):
        n = x.shape[0]
        d = len(x)
        return x.reshape(n // 2, -1) * d, n, n * 3 + 1, x.size()

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (4, 6, 8, 10):
        x = torch.randn(n, 3)
        assert_same(fn(x), f(x))
    assert len(backend.graphs) == 1


def test_loop_over_a_size_specializes_soundly():
    def f(x):
        out = x
        for _ in range(x.shape[0]):
            out = out + 1
        return out

    fn = torchweld.compile(f, backend=CountingBackend(), dynamic=True)
    for n in (3, 4, 3, 5):
        x = torch.randn(n)
        assert_same(fn(x), f(x))


def test_graph_break_with_a_size_live_across_it():
    def f(x):
        n = x.shape[0] * 2
        torchweld_break()
        return x.sum() * n

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (3, 4, 5):
        x = torch.randn(n)
        assert_same(fn(x), f(x))


@pytest.mark.parametrize("backend", ["eager", "weld"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_a_float_computed_from_a_size_kept_across_a_break_or_returned(backend, dynamic):
    """`x.size(-1) * 0.5` is a symbolic float; the code after the break (and the returned value)
    computes it again from the sizes, with torch.sym_float (NameError 'torch' from the second
    size on: the generated code's namespace had no torch)."""
    def f(x):
        scale = x.size(-1) * 0.5
        root = x.size(-1) ** -0.5
        torchweld_break()
        return x * scale + root, x.shape[0] * 0.5

    fn = torchweld.compile(f, backend=backend, dynamic=dynamic)
    for n in (4, 6, 8, 6):
        x = torch.randn(3, n)
        assert_same(fn(x), f(x))


def test_a_branch_on_a_float_of_a_size_is_guarded_without_recompiling_seen_sizes():
    def f(x):
        return x * 2 if x.size(-1) ** 0.5 > 3 else x

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (12, 13, 12, 4, 5, 13, 4):
        x = torch.randn(2, n)
        assert_same(fn(x), f(x))
    assert len(fn.cache_entries) == 2  # one for each side of the branch (the False side: no graph)


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_min_and_max_of_a_size_stay_symbolic(backend):
    """`min(x.shape[0], 4)`, `max(2, n)`: torch.sym_min / sym_max, as torch.compile keeps them, not
    one compile per size (a specialized first capture, then one symbolic)."""
    def f(x, y):
        n = min(x.shape[0], 4)
        m = max(2, y.shape[0])
        return x[:n] * 2, y.new_zeros(m) + n, n, m

    fn = torchweld.compile(f, backend=backend)
    for k in (3, 5, 6, 2, 7, 3):
        x, y = torch.randn(k, 2), torch.randn(k + 1)
        assert_same(fn(x, y), f(x, y))
    assert len(fn.cache_entries) <= 3  # (2 and 3 stay specialized: sizes 0 and 1 are never symbolic)


def torchweld_break():
    torchweld.graph_break()


def test_transposed_and_strided_inputs():
    def f(x):
        return x * 2 + x.shape[1]

    backend = CountingBackend()
    fn = torchweld.compile(f, backend=backend, dynamic=True)
    for n in (3, 5, 6):
        for x in (torch.randn(4, n).t(), torch.randn(n, 8)[:, ::2], torch.randn(n, 4)):
            assert_same(fn(x), f(x))


# -- marks ----------------------------------------------------------------------

def _marked_graphs(dynamic, sizes, mark) -> list:
    """The graphs of `views` compiled with `dynamic`, called on (n, 3, 4) tensors for n in
    `sizes`, each marked by `mark(x)` first; every call compared with eager."""
    backend = CountingBackend()
    fn = torchweld.compile(views, backend=backend, dynamic=dynamic)
    for n in sizes:
        x = torch.randn(n, 3, 4)
        mark(x)
        assert_same(fn(x), views(x))
    return backend.graphs


def test_mark_dynamic_makes_the_first_capture_symbolic_even_with_dynamic_false():
    graphs = _marked_graphs(False, (4, 6, 9), lambda x: torchweld.mark_dynamic(x, 0))
    assert len(graphs) == 1 and _symbolic_dims(graphs[0]) == [(0,)]


def test_torch_marks_are_honoured():
    assert len(_marked_graphs(None, (4, 6, 9), lambda x: torch._dynamo.mark_dynamic(x, 0))) == 1
    graphs = _marked_graphs(True, (4, 6), lambda x: torch._dynamo.mark_static(x, 0))
    assert len(graphs) == 2 and _symbolic_dims(graphs[0]) == [(1, 2)]


def test_mark_static_keeps_a_dim_specialized():
    assert len(_marked_graphs(True, (4, 6, 4), lambda x: torchweld.mark_static(x, 0))) == 2


def test_bad_dims_are_value_errors():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="out of range"):
        torchweld.mark_dynamic(x, 2)
    with pytest.raises(ValueError, match="out of range"):
        torchweld.mark_dynamic(x, -1)
    with pytest.raises(ValueError, match="out of range"):
        torchweld.mark_static(x, 5)
    with pytest.raises(ValueError, match="min=5 is above max=3"):
        torchweld.mark_dynamic(x, 0, min=5, max=3)


def test_marked_dim_that_capture_specializes_is_an_error_naming_the_line():
    def f(x):
        if x.shape[0] == 8:  # needs the exact size
            return x + 1
        return x - 1

    fn = torchweld.compile(f, backend=CountingBackend())
    x = torch.randn(8)
    torchweld.mark_dynamic(x, 0)
    with pytest.raises(DynamicDimSpecialized, match=r"L\['x'\]\.size\(\)\[0\] was marked dynamic.*test_dynamic_shapes.py"):
        fn(x)


def test_size_outside_a_marked_range_recompiles_specialized():
    graphs = _marked_graphs(False, (4, 6, 20, 5), lambda x: torchweld.mark_dynamic(x, 0, min=2, max=10))
    assert len(graphs) == 2
    assert _symbolic_dims(graphs[0]) == [(0,)] and _symbolic_dims(graphs[1]) == [()]


def test_size_outside_a_marked_range_under_fullgraph_is_an_error():
    fn = torchweld.compile(views, backend=CountingBackend(), fullgraph=True)
    x = torch.randn(4, 3, 4)
    torchweld.mark_dynamic(x, 0, min=2, max=10)
    assert_same(fn(x), views(x))
    x = torch.randn(20, 3, 4)
    torchweld.mark_dynamic(x, 0, min=2, max=10)
    with pytest.raises(DynamicDimSpecialized, match=r"L\['x'\]\.size\(\)\[0\] is 20, outside the range \[2, 10\]"):
        fn(x)


# -- logs and reports ---------------------------------------------------------------

def test_logs_say_which_dim_became_dynamic_and_why(caplog):
    fn = torchweld.compile(views, backend=CountingBackend())
    with torchweld.config.patch(logs="dynamic,recompiles"), caplog.at_level(logging.INFO, logger="torchweld"):
        fn(torch.randn(4, 3, 4))
        fn(torch.randn(6, 3, 4))
    messages = [r.getMessage() for r in caplog.records]
    assert any("L['x']: dim 0 becomes symbolic: size changed from 4 to 6" in m for m in messages), messages
    assert any("recompiling" in m and "L['x'].shape == (4, 3, 4) (got (6, 3, 4))" in m for m in messages), messages
    guards = fn.cache_entries[1].report.guards
    assert any(g.startswith("symbolic sizes: s") and ">= 2" in g for g in guards), guards


# -- training --------------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [None, True])
def test_training_with_varying_length_gives_eager_gradients(dynamic):
    torch.manual_seed(0)
    model = Block()
    reference = Block()
    reference.load_state_dict(model.state_dict())
    backend = CountingBackend()
    compiled = torchweld.compile(model, backend=backend, dynamic=dynamic)
    for t in (5, 8, 6, 11):
        x = torch.randn(2, t, 16)
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert len(backend.graphs) <= (2 if dynamic is None else 1)


def test_a_broken_size_relation_is_named_in_the_recompile_log(caplog):
    """The size guard checks every relation at once; the recompile message names the one that
    failed and the symbols' values, not the whole guard."""
    fn = torchweld.compile(lambda x, y: x + y, backend=CountingBackend(), dynamic=True)
    fn(torch.randn(4), torch.randn(4))
    with torchweld.config.patch(logs="recompiles"), caplog.at_level(logging.INFO, logger="torchweld"):
        fn(torch.randn(6), torch.randn(1))
    messages = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert len(messages) == 1
    assert re.search(r"guard failed: symbolic sizes: L\['y'\]\.size\(\)\[0\] == s\d+ \(got False, with s\d+ = 6\)$",
                     messages[0]), messages


class _Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, n):
        return self.linear(x[:, :n]).relu().sum(1) * n


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_an_int_argument_trains_symbolic_under_weld(backend):
    """An int argument that changes is a symbol after the second value (weld compiles its code per
    value still); outputs and gradients equal eager's for every value, 0 and 1 included."""
    import copy

    torch.manual_seed(0)
    model = _Counted()
    eager = copy.deepcopy(model)
    counting = CountingBackend()
    compiled = torchweld.compile(model, backend=counting if backend == "eager" else "weld")
    for n in (3, 5, 6, 7, 1, 0, 4):
        x = torch.randn(4, 8, 8)
        out, expected = compiled(x, n), eager(x, n)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    if backend == "eager":
        assert len(counting.graphs) <= 4  # 3 specialized, 5 symbolic, 1 and 0 (slices of 0/1 specialize)


def test_an_int_argument_under_dynamic_false_compiles_each_value():
    backend = CountingBackend()
    compiled = torchweld.compile(int_argument, backend=backend, dynamic=False)
    for n in (4, 5, 7):
        assert_same(compiled(torch.ones(2, 9), n), int_argument(torch.ones(2, 9), n))
    assert len(backend.graphs) == 3


def _divides_by_an_int(x, n):
    try:
        n = 10 // n
    except ZeroDivisionError:
        n = 0
    return x + n, n % 7 if n else -1


def _float_times_int(x, n, s=0.0):
    return x * 2, s * n, 1.5 * n


@pytest.mark.parametrize("dynamic", [None, True])
def test_symbolic_int_arithmetic_keeps_pythons_errors_and_types(dynamic):
    """Found by the fuzzer: a graph dividing by a symbolic int raised ZeroDivisionError outside
    the user's `try` when a later call passed 0 (the divisor is now guarded nonzero); `0.0 * n`
    came back as the int 0 (sympy simplifies it; a float is spelled `float(...)`)."""
    for fn, values in ((_divides_by_an_int, (-2, 2, 5, 0, 3, 0)), (_float_times_int, (-1, 5, 0, 3))):
        compiled = torchweld.compile(fn, backend=CountingBackend(), dynamic=dynamic)
        for n in values:
            x = torch.randn(3)
            assert_same(compiled(x, n), fn(x, n))


OFFSET = 1


def _int_and_state(x, n, seen, k=2):
    seen.append(n)
    return x[:n] * k + OFFSET + n, len(seen)


def test_a_symbolic_int_with_state_changed_between_calls():
    """Once `n` is a symbol, the graph still answers to a global, a default and a list passed
    in that change between calls, as eager does."""
    global OFFSET
    backend = CountingBackend()
    compiled = torchweld.compile(_int_and_state, backend=backend)
    defaults = _int_and_state.__defaults__
    try:
        for step, n in enumerate((3, 5, 7, 4, 6)):
            OFFSET = step
            _int_and_state.__defaults__ = (step % 3,)
            x = torch.randn(9)
            ours, theirs = [step], [step]
            assert_same(compiled(x, n, ours), _int_and_state(x, n, theirs))
            assert ours == theirs
    finally:
        OFFSET = 1
        _int_and_state.__defaults__ = defaults


# -- tensors read through attributes: automatic dynamic as torch.compile (not parameters or buffers)

class _Holder:
    def __init__(self, t):
        self.t = t


class _WithPlainAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.extra = torch.zeros(3)  # a plain tensor attribute, not a buffer

    def forward(self, h):
        return self.lin(h.t).sum(0) * self.extra.sum() + self.extra.mean()


_GLOBAL_HOLDER = _Holder(torch.zeros(2))


def _reads_a_global_objects_tensor(x):
    return x * 2 + _GLOBAL_HOLDER.t


def _attribute_calls(kind):
    """(fn, a generator of each call's arguments, which changes the state it reads)."""
    torch.manual_seed(0)
    if kind == "object attribute":
        return _WithPlainAttribute(), lambda: ((_Holder(torch.randn(n, 4)),) for n in SIZES)
    if kind == "module attribute":
        module = _WithPlainAttribute()

        def calls():
            for n in SIZES:
                module.extra = torch.randn(n)
                yield (_Holder(torch.randn(2, 4)),)
        return module, calls
    if kind == "global object attribute":
        def calls():
            for n in SIZES:
                _GLOBAL_HOLDER.t = torch.randn(n)
                yield (torch.randn(n),)
        return _reads_a_global_objects_tensor, calls
    raise KeyError(kind)


def _symbolic_placeholders(gm) -> int:
    return sum(isinstance(n, torch.SymInt) for node in gm.graph.nodes if node.op == "placeholder"
               for n in getattr(node.meta.get("example_value"), "shape", ()))


@pytest.mark.parametrize("kind", ["object attribute", "module attribute", "global object attribute"])
def test_tensors_read_through_attributes_become_dynamic_as_under_torch_compile(kind):
    fn, calls = _attribute_calls(kind)
    ours = CountingBackend()
    compiled = torchweld.compile(fn, backend=ours)
    for args in calls():
        assert_same(compiled(*args), fn(*args))
    torch._dynamo.reset()
    fn, calls = _attribute_calls(kind)
    theirs = CountingBackend()
    compiled = torch.compile(fn, backend=theirs)
    for args in calls():
        compiled(*args)
    torch._dynamo.reset()
    assert len(ours.graphs) == len(theirs.graphs) == 2
    assert _symbolic_placeholders(ours.graphs[-1]) >= 1 and _symbolic_placeholders(theirs.graphs[-1]) >= 1


class _GrowingCache:
    """A KV cache object as transformers' DynamicCache: a list of tensors grown by torch.cat."""

    def __init__(self):
        self.keys = [torch.ones(1, 2, 3, 4)]


def _decode_step(x, cache):
    keys = torch.cat([cache.keys[0], x], dim=2)
    cache.keys[0] = keys
    return (keys.softmax(2) * keys.shape[2]).sum(2)


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_cache_object_growing_each_call_compiles_twice_then_never_again(backend):
    """A generation loop: the cache object's tensor grows by one each call (recompiled at every
    length before tensors read through attributes could be dynamic)."""
    compiled = torchweld.compile(_decode_step, backend=backend)
    mine, theirs = _GrowingCache(), _GrowingCache()
    for _ in range(12):
        x = torch.randn(1, 2, 1, 4)
        assert_same(compiled(x, mine), _decode_step(x, theirs))
        assert_same(mine.keys[0], theirs.keys[0])
    assert len(compiled.cache_entries) == 2


def test_transformers_generate_with_its_dynamic_cache_captures_as_torch_compile():
    """GPT-2's greedy generation with transformers' DynamicCache: the prompt, the first token, then
    one symbolic version for every later cache length (torch.compile: the same 3), tokens equal."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 300, (1, 6))
    generate = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, min_new_tokens=16)
    with torch.no_grad():
        expected = model.generate(ids, **generate)
        counts = []
        for compile_ in (torchweld.compile, torch.compile):
            backend = CountingBackend()
            model.forward = compile_(type(model).forward.__get__(model), backend=backend)
            assert torch.equal(model.generate(ids, **generate), expected)
            counts.append(len(backend.graphs))
            del model.forward
            torch._dynamo.reset()
    assert counts[0] == counts[1] == 3


class _State:
    def __init__(self, n):
        self.t = torch.arange(float(n))
        self.scale = 2.0


def _reads_and_writes_an_attribute(x, state):
    n = state.t.shape[0]
    state.t.mul_(state.scale)  # written in place: the caller's tensor changes
    y = x[:n] * state.t + state.t.sum() / n
    return y.view(-1, 1).expand(n, 2).sum(0), n


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_an_attribute_tensor_changing_size_and_state_between_calls(backend):
    """A tensor held by an argument object, replaced by one of another size between calls,
    written in place, its size returned, and the object's float changed: every call as eager's."""
    compiled = torchweld.compile(_reads_and_writes_an_attribute, backend=backend)
    for n, scale in ((3, 2.0), (5, 2.0), (5, -1.0), (7, 0.5), (4, 0.5), (5, 3.0), (7, 0.5)):
        mine, theirs = _State(n), _State(n)
        mine.scale = theirs.scale = scale
        x = torch.randn(9)
        assert_same(compiled(x, mine), _reads_and_writes_an_attribute(x, theirs))
        assert_same(mine.t, theirs.t)
    # the first size, one symbolic version, and one where the float became a graph input (the
    # in-place mul_ takes it as a 0-d tensor): 3 versions, as torch.compile's
    assert len(compiled.cache_entries) == 3


# -- float arguments: graph inputs once they changed, as torch.compile's unspecialized floats

def _scaled(x, lr):
    return x * lr + 1, lr * x - x, x + lr


def test_a_float_argument_compiles_twice_as_under_torch_compile():
    calls = [(torch.randn(3), lr) for lr in (0.1, 0.2, 0.3, 0.4, 0.5)]
    ours = CountingBackend()
    compiled = torchweld.compile(_scaled, backend=ours)
    for args in calls:
        got, want = compiled(*args), _scaled(*args)
        assert all(torch.equal(g, w) for g, w in zip(got, want))  # bit for bit: aten rounds the float alike
    torch._dynamo.reset()
    theirs = CountingBackend()
    compiled = torch.compile(_scaled, backend=theirs)
    for args in calls:
        compiled(*args)
    torch._dynamo.reset()
    assert len(ours.graphs) == len(theirs.graphs) == 2


def _uses_a_float(x, s, t=0.5):
    y = x * s - t * x
    if s > 0.25:  # Python compares it: guarded on the answer
        y = y + 1
    return y * (2 * t), s  # Python computes with t: a derived number, an input too; s returned as it came


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_float_arguments_read_as_inputs_keep_eager_results(backend):
    compiled = torchweld.compile(_uses_a_float, backend=backend)
    for s, t in ((0.1, 0.5), (0.2, 0.5), (0.3, 0.5), (0.35, 0.7), (0.4, 0.9), (0.3, 0.7), (0.26, 0.9)):
        x = torch.randn(4, dtype=torch.float64)
        got, want = compiled(x, s, t), _uses_a_float(x, s, t)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and type(got[1]) is float
    # 0.1; then a version a side of `s > 0.25` while t keeps its first value: (0.2, 0.5), (0.3, 0.5);
    # then one where t is an input too: (0.35, 0.7) and every later call
    assert len(compiled.cache_entries) == 4


def _ema(x, average, decay):
    # Python arithmetic on a float that changes each call (a decay schedule): derived numbers
    return average * decay + (1 - decay) * x, x / (decay * 4) - (-decay) * x


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_python_arithmetic_on_a_float_input_is_an_input_bit_for_bit(backend):
    """`1 - decay`, `decay * 4`, `-decay` of a float that changes: the holder does Python's
    arithmetic again at each call, so no value is a new version, and the results are eager's
    bit for bit (float32 and float64 tensors)."""
    for dtype in (torch.float32, torch.float64):
        counting = CountingBackend()
        compiled = torchweld.compile(_ema, backend=counting if backend == "eager" else backend)
        for decay in (0.9, 0.99, 0.995, 0.5, 1e-3, 0.0):
            x, average = torch.randn(7, dtype=dtype), torch.randn(7, dtype=dtype)
            got, want = compiled(x, average, decay), _ema(x, average, decay)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (backend, dtype, decay)
        if backend == "eager":
            assert len(counting.graphs) == 2


def _graph_counts(fn, calls: list[tuple]) -> list[int]:
    """The graphs torchweld and torch.compile make of `fn` called with each argument tuple."""
    counts = []
    for compile_ in (torchweld.compile, torch.compile):
        torch._dynamo.reset()
        backend = CountingBackend()
        compiled = compile_(fn, backend=backend)
        for args in calls:
            compiled(*args)
        counts.append(len(backend.graphs))
    torch._dynamo.reset()
    return counts


def test_python_arithmetic_on_a_float_input_compiles_as_often_as_under_torch_compile():
    counts = _graph_counts(_ema, [(torch.randn(7), torch.randn(7), decay) for decay in (0.9, 0.99, 0.995, 0.5)])
    assert counts[0] == counts[1] == 2


def _inverse_temperature(x, t):
    return x * (1 / t)


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_float_input_python_divides_by_is_guarded_nonzero(backend):
    """`1 / t` of a float input: an input too, guarded t != 0, so that t = 0 raises
    ZeroDivisionError at the user's line as in eager, and the next value runs the graph again."""
    counting = CountingBackend()
    compiled = torchweld.compile(_inverse_temperature, backend=counting if backend == "eager" else backend)
    for t in (0.5, 0.7, 2.0, 0.0, -0.0, 1.3):
        x = torch.randn(5)
        try:
            want = _inverse_temperature(x, t)
        except ZeroDivisionError:
            with pytest.raises(ZeroDivisionError):
                compiled(x, t)
            continue
        assert torch.equal(compiled(x, t), want), t
    if backend == "eager":
        assert len(counting.graphs) == 2


def _derived_elsewhere(x, lr):
    scaled = 2 * lr + 1
    if scaled > 2:  # a comparison of a derived number: guarded on lr's value
        x = x + 1
    return torch.full((3,), scaled) * x, scaled, -lr


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_derived_float_used_as_a_constant_is_guarded_on_its_input(backend):
    """Where a derived number is no tensor operation's operand (a comparison, a factory, a
    returned float) it is a constant, and the float it came from is guarded on its value."""
    compiled = torchweld.compile(_derived_elsewhere, backend=backend)
    for lr in (0.1, 0.7, 0.3, 0.9, 0.1):
        x = torch.randn(3)
        got, want = compiled(x, lr), _derived_elsewhere(x, lr)
        assert torch.equal(got[0], want[0]) and got[1:] == want[1:] and type(got[1]) is float, lr


def test_an_optimizer_learning_rate_set_from_a_derived_float_follows_it():
    """`group["lr"] = 2 * lr` inside the compiled step: the optimizer reads that number as a
    constant guarded on lr, never lr itself."""
    def step(model, opt, x, lr):
        opt.param_groups[0]["lr"] = 2 * lr
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    compiled = torchweld.compile(step, backend="eager")
    for lr in (0.1, 0.05, 0.2, 0.05):
        x = torch.randn(3, 4)
        step(models[0], opts[0], x, lr)
        compiled(models[1], opts[1], x, lr)
        for a, b in zip(models[0].parameters(), models[1].parameters()):  # lr for 2 * lr: ~1e-2 off
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _times(x, s):
    return x * s


def test_a_float_with_integer_or_half_tensors_stays_a_constant():
    """A 0-d tensor would change the result: an int tensor times a float is float32 (a float64
    tensor would make it float64), and a bfloat16 one computes in float32 (a bfloat16 tensor
    would round the float first)."""
    compiled = torchweld.compile(_times, backend="eager")
    for s in (0.5, 1.5, 2.7):
        for x in (torch.arange(4), torch.randn(4, dtype=torch.bfloat16), torch.randn(4)):
            got, want = compiled(x, s), _times(x, s)
            assert got.dtype == want.dtype and torch.equal(got, want)


# a float that changes, taken by torch operations as a 0-d tensor (number_operands.py); the
# second element of each pair: whether torch.compile (dynamo's unspecialized floats) and
# torchweld make it an input (2 graphs over 5 values) or keep it a constant (5 graphs)
_FLOAT_OPERANDS = {
    "divided by": (lambda x, s: x / s, True),
    "torch.div": (lambda x, s: torch.div(x, s), True),
    "div_ in place": (lambda x, s: x.clone().div_(s), True),
    "mul method": (lambda x, s: x.mul(s), True),
    "sub_ in place": (lambda x, s: x.clone().sub_(s), True),
    "torch.add": (lambda x, s: torch.add(x, s), True),
    "clamp max": (lambda x, s: torch.clamp(x, max=s), True),
    "clamp both": (lambda x, s: x.clamp(min=s, max=s), True),
    "clamp_min": (lambda x, s: torch.clamp_min(x, s), True),
    "where": (lambda x, s: torch.where(x > 0, x, s), True),
    "where, number first": (lambda x, s: torch.where(x > 0, s, x), True),
    "masked_fill": (lambda x, s: x.masked_fill(x > 0, s), True),
    "number divided": (lambda x, s: s / x, False),  # eager computes reciprocal(x) * s
    "floor division": (lambda x, s: torch.div(x, s, rounding_mode="floor"), False),
    "add with alpha": (lambda x, s: torch.add(x, s, alpha=2), False),
    "clamp with a constant bound": (lambda x, s: torch.clamp(x, 0.0, s), False),
}


@pytest.mark.parametrize("name", list(_FLOAT_OPERANDS))
def test_floats_taken_by_torch_operations_are_inputs_bit_for_bit(name):
    fn, as_input = _FLOAT_OPERANDS[name]
    values = (0.5, 0.7, -1.3, 2.1, 0.0)
    for dtype in (torch.float32, torch.float64):
        ours = CountingBackend()
        compiled = torchweld.compile(fn, backend=ours)
        for s in values:
            x = torch.randn(6, dtype=dtype)
            got, want = compiled(x, s), fn(x, s)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, dtype, s)
        assert len(ours.graphs) == (2 if as_input else len(values)), (name, dtype)


@pytest.mark.parametrize("name", ["divided by", "clamp max", "where", "masked_fill"])
def test_floats_taken_by_torch_operations_match_torch_compiles_graph_count(name):
    fn, _ = _FLOAT_OPERANDS[name]
    counts = _graph_counts(fn, [(torch.randn(6), s) for s in (0.5, 0.7, 1.3, 2.1)])
    assert counts[0] == counts[1] == 2


def test_a_float_operand_on_weld_follows_each_value():
    """weld's kernels read the 0-d tensor: a division, a clamp and a masked fill, called with
    floats that change, in place and not, against eager."""
    def fn(x, temperature, limit):
        y = (x / temperature).clamp(max=limit)
        y.mul_(temperature)
        return y.masked_fill(y < 0, limit)

    compiled = torchweld.compile(fn, backend="weld")
    for t, lim in ((0.7, 1.0), (0.9, 1.5), (1.3, 0.25), (1e-3, 4.0), (0.9, 1.5)):
        x = torch.randn(32)
        assert torch.equal(compiled(x, t, lim), fn(x, t, lim))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_a_float_divisor_on_cuda_is_eagers_product_with_its_reciprocal(backend):
    def fn(x, s):  # each output one operation: Triton contracts a product and a sum into an fma
        return x / s, torch.div(x, s), x.div(s), x / (s * 4 - 1)  # the last: a derived number

    compiled = torchweld.compile(fn, backend=backend)
    for s in (3.0, 0.1, 7.3e-5, -2.5, 3.0, 1e30):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(1000, device="cuda", dtype=dtype)
            for got, want in zip(compiled(x, s), fn(x, s)):
                assert torch.equal(got, want), (s, dtype)


def test_the_cuda_division_holds_the_reciprocal_eager_multiplies_by():
    """On CUDA eager divides a float32 tensor by a Python float as a product with the float's
    reciprocal, computed in float32 (the float rounded first); the holder's reciprocal is that
    one, checked against numpy's float32 and float64 arithmetic, not against torch's own."""
    import numpy as np

    from torchweld.capture.number_operands import _reciprocal_in

    for s in (3.0, 0.1, 7.3e-5, -2.5, 0.0, 1 / 3):
        for dtype, np_dtype in ((torch.float32, np.float32), (torch.float64, np.float64)):
            with np.errstate(divide="ignore"):
                want = float(np_dtype(1.0) / np_dtype(s))
            got = _reciprocal_in(dtype)(s)
            assert got == want or (math.isinf(want) and got == want), (s, dtype, got, want)
            assert torch.tensor(got, dtype=dtype).item() == got  # exactly what the 0-d tensor holds


def test_a_float_input_is_its_own_per_thread_and_keeps_the_sign_of_zero():
    """Threads calling one compiled function with their own floats each read theirs (one
    tensor refilled by both raced between a fill and the graph); -0.0 is not 0.0."""
    import threading

    compiled = torchweld.compile(_scaled, backend="eager")
    x = torch.ones(3)
    compiled(x, 0.1)
    compiled(x, 0.2)  # the float is a graph input from here
    wrong = []

    def work(lr: float) -> None:
        for _ in range(300):
            got, want = compiled(x, lr), _scaled(x, lr)
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                wrong.append(lr)

    threads = [threading.Thread(target=work, args=(lr,)) for lr in (0.25, 0.75, 1.5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    for lr in (0.0, -0.0, 0.0):
        got, want = compiled(x, lr), _scaled(x, lr)
        assert all(torch.equal(g, w) and torch.equal(g.signbit(), w.signbit()) for g, w in zip(got, want))
    assert len(compiled.cache_entries) == 2


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 0.5  # a module's float: a setting, a constant as under torch.compile

    def forward(self, x, cfg):
        return x * cfg.t * self.scale, cfg.t


def test_a_float_attribute_of_an_object_is_an_input_and_a_modules_stays_a_constant():
    calls = [(torch.randn(3), _Holder(t)) for t in (0.5, 0.7, 0.9, 1.1)]
    counts = []
    for compile_ in (torchweld.compile, torch.compile):
        backend, model = CountingBackend(), _Scaled()
        compiled = compile_(model, backend=backend)
        for x, cfg in calls:
            got, want = compiled(x, cfg), model(x, cfg)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
        model.scale = 0.25  # the module's setting changed: a new version, read as a constant
        x, cfg = calls[0]
        assert torch.equal(compiled(x, cfg)[0], model(x, cfg)[0])
        counts.append(len(backend.graphs))
        torch._dynamo.reset()
    assert counts[0] == counts[1] == 3


def _membership(x, n):
    return x + (1 if n in (1, 2, 3) else 2) + n


def test_membership_of_a_symbolic_int_guards_the_answer_not_the_value():
    """`n in (1, 2, 3)`: values outside the set share one version (each `n != v` guarded); a value
    inside it is that value (the ShapeEnv replaces the symbol)."""
    backend = CountingBackend()
    compiled = torchweld.compile(_membership, backend=backend)
    for n in (5, 6, 7, 8, 15, 2, 3, 16, 40, 1, 2):
        assert torch.equal(compiled(torch.ones(2), n), _membership(torch.ones(2), n))
    assert len(backend.graphs) == 5  # 5; the rest outside the set; 2; 3; 1


_GLOBAL_SHIFT = 1.0


def _float_with_state(x, seen, cfg, s=0.5):
    seen.append(s)  # the floats also divide and bound (number_operands.py): inputs there too
    y = ((x * s + cfg.t * x - _GLOBAL_SHIFT) / cfg.t).clamp(max=s)
    # and Python computes with them (derived numbers; returning one would guard s's value)
    return y + (1 - s) * x - x * (2 * cfg.t) - 2 * _GLOBAL_SHIFT, len(seen), cfg.t


@pytest.mark.parametrize("backend", ["eager", "weld"])
def test_float_inputs_follow_defaults_globals_containers_and_an_objects_attribute(backend):
    """The float inputs called again after the program's state changed: the function's default,
    a global float (a constant, guarded), the list passed in, the same config object's attribute;
    Python arithmetic on them (`1 - s`, `2 * cfg.t`) follows each change too. Versions are called
    again with other floats (calls 4 and 6)."""
    global _GLOBAL_SHIFT
    compiled = torchweld.compile(_float_with_state, backend=backend)
    mine, theirs = _Holder(0.25), _Holder(0.25)
    seen_mine, seen_theirs = [], []
    try:
        for default, shift, t in ((0.5, 1.0, 0.25), (0.75, 1.0, 0.25), (0.75, 2.0, 0.5), (-0.0, 2.0, 1.5),
                                  (1.25, 1.0, -2.0), (0.5, 1.0, 0.25)):
            _float_with_state.__defaults__ = (default,)
            _GLOBAL_SHIFT = shift
            mine.t = theirs.t = t
            # the lists emptied, as at the first call (a list that grew would be another version
            # each call, and no version would be called again with new floats)
            seen_mine.clear()
            seen_theirs.clear()
            x = torch.randn(4)
            got, want = compiled(x, seen_mine, mine), _float_with_state(x, seen_theirs, theirs)
            assert torch.equal(got[0], want[0]) and got[1:] == want[1:] and seen_mine == seen_theirs
            assert [math.copysign(1.0, v) for v in seen_mine] == [math.copysign(1.0, v) for v in seen_theirs]
    finally:
        _float_with_state.__defaults__ = (0.5,)
        _GLOBAL_SHIFT = 1.0
