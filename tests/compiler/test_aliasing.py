"""In-place writes through views (compiler/aliasing.py and the lowering's writes): a write
through a view of an input reaches only the view's elements of it, every other view of the
written tensor sees it, and an output that views an input stays a view of it, as in eager."""
import re

import pytest
import torch
import torch.utils._pytree as pytree

import torchweld
from torchweld.compiler import aliasing, ir
from torchweld.compiler.ir import Layout


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _compare(fn, make_inputs, calls: int = 3):
    """Call `fn` compiled and eagerly on equal fresh inputs `calls` times: equal outputs, equal
    inputs afterwards, and each output a view of the same input (at the same offset and
    strides) in both, or of none."""
    compiled = torchweld.compile(fn)
    for call in range(calls):
        mine, theirs = make_inputs(call), make_inputs(call)
        got, want = compiled(*mine), fn(*theirs)
        torch.testing.assert_close(got, want)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b)
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            assert [g is a for a in mine] == [w is b for b in theirs], "an output is an input where eager's is not"
            shares = [_storage(g) == _storage(a) for a in mine]
            assert shares == [_storage(w) == _storage(b) for b in theirs], "an output views other inputs than eager's"
            if any(shares):
                assert (g.storage_offset(), g.stride()) == (w.storage_offset(), w.stride())


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _square(call):
    return [torch.arange(4.0).reshape(2, 2) + call, torch.tensor(3.0 + call)]


def _wide(call):
    return [torch.arange(12.0).reshape(3, 4) * (call + 1)]


def test_in_place_write_through_a_row_reaches_only_that_row():
    """`z = x[:1]; z.mul_(c)` on a 2x2 x wrote row 0 over row 1 of the caller's tensor."""
    def fn(x, c):
        z = x[:1]
        z.mul_(c)
        return z

    _compare(fn, _square)


def test_the_base_read_after_a_write_through_its_view_sees_it():
    def fn(x, c):
        z = x[:1]
        z.mul_(c)
        return x + 0

    _compare(fn, _square)


def test_a_view_taken_before_a_write_to_its_base_sees_the_write():
    def fn(x):
        flat = x.view(-1)
        column = x[:, 1]
        x.add_(1)
        return flat * 2, column + 0

    _compare(fn, _wide)


def test_item_assignments_and_augmented_assignments_into_slices():
    def fn(x, c):
        x[:, 0] = c
        x[1:, 1:] += 1
        x[0] *= 2
        return x + 1

    _compare(fn, lambda call: [_randn(3, 4, seed=call), _randn(3, seed=call + 10)])


@pytest.mark.parametrize("view", ["t", "diagonal", "column", "strided", "unbind"])
def test_writes_through_other_views(view):
    def fn(x):
        if view == "t":
            x.t().add_(1)
        elif view == "diagonal":
            x.diagonal().zero_()
        elif view == "column":
            x[:, 2].fill_(-1.0)
        elif view == "strided":
            x[::2, 1::2].mul_(10)
        else:
            a, b, c = x.unbind(0)
            b.sub_(a)
        return x * 2, x.sum(1)

    _compare(fn, lambda call: [_randn(3, 3, seed=call)])


def test_writes_into_inputs_that_are_views_of_larger_tensors():
    """An input with a storage offset and a transposed one: the write lands at the view's
    elements of the caller's memory, whatever its offset and strides."""
    def fn(x, y):
        x[1:, :2].add_(5)
        y[0].mul_(3)
        return x.sum(), y

    def inputs(call):
        whole = torch.arange(30.0).reshape(5, 6) + call
        return [whole[1:4, 1:5], torch.arange(12.0).reshape(3, 4).t()]

    _compare(fn, inputs)


def test_returned_views_of_an_input_written_in_place_stay_views():
    """Eager's output shares the input's storage: compiled ones were new tensors."""
    cases = [
        lambda x: (x.add_(1), x.t())[1],
        lambda x: (x.mul_(2), x[1:])[1],
        lambda x: x.add_(1),
        lambda x: (x[1:].mul_(3), x[:, 1:])[1],
    ]
    for fn in cases:
        torchweld.reset()
        _compare(fn, _wide)


def test_writes_into_intermediates_through_views():
    def fn(x):
        y = x * 2
        y[:, 1] = 0
        y[0].add_(y[1])
        return y, y.sum()

    _compare(fn, _wide)


def test_a_cache_written_at_one_position_then_read():
    """A key/value cache's pattern: one slot written, then the filled part read."""
    def fn(cache, k):
        cache[:, 2] = k
        return cache[:, :3].sum(1)

    _compare(fn, lambda call: [torch.zeros(2, 5, 4) + call, _randn(2, 4, seed=call)])


def test_chained_in_place_ops_write_the_input_once():
    _compare(lambda x: x.add_(1).mul_(2).sub_(x[0].clone()), _wide)


def test_a_write_through_a_view_is_not_a_write_over_the_base():
    """The write-back copies the view's elements alone: the rest of the caller's tensor is
    never rewritten (another thread may be writing it)."""
    from torchweld.compiler import compile_graph

    def fn(x):
        x[:, 1].add_(1)
        return x.sum()

    def backend(gm, example_inputs):
        backend.compiled = compile_graph(gm, example_inputs)
        return backend.compiled

    torchweld.compile(fn, backend=backend)(torch.zeros(3, 4))
    source = backend.compiled.wrapper_source
    assert "arg1.as_strided((3,), (4,), arg1.storage_offset() + 1).copy_(" in source
    assert not re.search(r"(?<!_caller_)arg1\.copy_\(", source)  # only a restrided copy goes back whole


# -- the index arithmetic -------------------------------------------------------------


def test_unflatten_finds_each_element_of_a_nested_layout_and_no_other():
    view = Layout((2, 3), (1, 4), 1)  # a transposed slice
    found = aliasing.unflatten(ir.var("p"), view)
    index, inside = found
    held = {1 + i + 4 * j: (i, j) for i in range(2) for j in range(3)}
    for p in range(-2, 16):
        values = {"p": p}
        assert _evaluate(inside, values) == (p in held)
        if p in held:
            assert tuple(_evaluate(e, values) for e in index) == held[p]


def test_unflatten_refuses_layouts_whose_elements_it_cannot_tell_apart():
    assert aliasing.unflatten(ir.var("p"), Layout((3, 2), (2, 3))) is None  # offsets nest in no order
    assert aliasing.unflatten(ir.var("p"), Layout((4,), (0,))) is None  # an expanded view


def _evaluate(e: ir.Expr, values: dict):
    """`e` evaluated as C++ kernels do (integer division truncates)."""
    from torchweld.compiler.ir import Op

    if e.op is Op.CONST:
        return e.arg
    if e.op is Op.VAR:
        return values[e.arg]
    a = [_evaluate(x, values) for x in e.args]
    truncated = lambda n, d: abs(n) // abs(d) * (1 if (n < 0) == (d < 0) else -1)  # noqa: E731
    return {
        Op.ADD: lambda: a[0] + a[1], Op.MUL: lambda: a[0] * a[1], Op.IDIV: lambda: truncated(a[0], a[1]),
        Op.IMOD: lambda: a[0] - truncated(a[0], a[1]) * a[1], Op.MAXIMUM: lambda: max(a), Op.MINIMUM: lambda: min(a),
        Op.GE: lambda: a[0] >= a[1], Op.LT: lambda: a[0] < a[1], Op.EQ: lambda: a[0] == a[1],
        Op.LOGICAL_AND: lambda: a[0] and a[1],
    }[e.op]()


def test_a_written_input_the_wrapper_restrided_gets_its_new_values():
    """An input whose strides differ from the compiled ones is copied into them (wrapper's
    _restride); its writes went to that copy alone."""
    from torchweld.compiler import compile_graph

    def fn(x):
        x[:, 1].add_(1)
        return x.sum()

    with torch.no_grad():
        compiled = compile_graph(torch.fx.symbolic_trace(fn), [torch.zeros(3, 4)])
    for call in range(3):
        mine = torch.arange(12.0).reshape(4, 3).t() + call  # strides (1, 3), not (4, 1)
        theirs = mine.clone()
        torch.testing.assert_close(compiled(mine), fn(theirs))
        torch.testing.assert_close(mine, theirs)


def test_a_view_with_the_inputs_layout_is_a_view_not_the_input():
    """y.view(2, 2).flatten() has y's layout: weld returned y itself, eager a new view of it
    (whose requires_grad_, resize_ or attributes do not reach y)."""
    cases = [lambda y: y.view(2, 2).flatten(), lambda y: (y.unsqueeze(0).squeeze(0), y.view(-1), y)]
    for fn in cases:
        torchweld.reset()
        _compare(fn, lambda call: [torch.arange(4.0) + call])


def test_detach_is_a_tensor_of_its_own():
    """`x.detach()` is a new tensor sharing x's memory in eager; weld returned x itself. A view of
    an intermediate returned beside it (`t, t.view(-1)`, `t, t.detach()`) is another tensor too."""
    for fn in [lambda y: y.detach(), lambda y: (y.detach(), y.detach(), y),
               lambda y: (lambda t: (t, t))(y.detach()), lambda y: y.add_(1).detach()]:
        torchweld.reset()
        _compare(fn, lambda call: [torch.arange(4.0) + call])
    for fn in [lambda y: (lambda t: (t, t.detach()))(y + 1), lambda y: (lambda t: (t, t.view(-1), t[:]))(y * 2),
               lambda y: (lambda t: (t, t.detach(), t))(y + 1)]:
        torchweld.reset()
        compiled = torchweld.compile(fn)
        for call in range(3):
            y = torch.arange(4.0) + call
            got, want = compiled(y), fn(y.clone())
            torch.testing.assert_close(got, want)
            assert [[a is b for b in got] for a in got] == [[a is b for b in want] for a in want]
            assert len({_storage(t) for t in got}) == 1


def _sharing(make_other):
    """Inputs (x, y): on odd calls y = make_other(x), sharing x's memory; on even ones a tensor of its own."""
    def inputs(call):
        x = torch.arange(16.0).reshape(4, 4) + call
        return [x, make_other(x) if call % 2 else make_other(x.clone())]
    return inputs


@pytest.mark.parametrize("make_other", [lambda x: x.detach(), lambda x: x[:], lambda x: x.t()],
                         ids=["detach", "slice", "transpose"])
def test_an_input_sharing_memory_with_a_written_input_sees_the_write(make_other):
    """Fuzzer class 10: x and y = x.detach() are two inputs; a write into y (here through a view)
    must reach x's later reads. weld's kernels read x as it was: such calls run as captured."""
    def fn(x, y):
        y[1:].mul_(-1)
        return x - y, x.sum()

    _compare(fn, _sharing(make_other), calls=4)


def test_a_written_view_input_of_another_input():
    """y = x[1] written whole (`add_`, an assignment through it) while x is read after."""
    def fn(x, y):
        y.add_(1)
        y[0] = x[0, 0]
        return x * 2

    _compare(fn, _sharing(lambda x: x[1]), calls=4)


def test_written_inputs_whose_memory_does_not_meet_run_the_kernels():
    """x[0] and x[1] share a storage but no element: the check lets the compiled kernels run."""
    from torchweld.backends import lookup_backend
    from torchweld.runtime.input_overlap import OverlapChecked

    def fn(a, b):
        a.mul_(2)
        return a + b

    gm = torch.fx.symbolic_trace(fn)
    with torch.no_grad():
        compiled = lookup_backend("weld")(gm, [torch.randn(4), torch.randn(4)])
    assert isinstance(compiled, OverlapChecked)
    ran = []
    compiled.exact = lambda *args: ran.append(args) or gm(*args)
    for rows, exact in [((0, 1), False), ((1, 1), True), ((1, 0), False)]:
        x, x_eager = torch.arange(8.0).reshape(2, 4), torch.arange(8.0).reshape(2, 4)
        with torch.no_grad():
            got = compiled(x[rows[0]], x[rows[1]])
        torch.testing.assert_close(got, fn(x_eager[rows[0]], x_eager[rows[1]]))
        torch.testing.assert_close(x, x_eager)
        assert bool(ran) == exact
        ran.clear()


def test_graphs_that_write_nothing_are_not_checked():
    from torchweld.backends import lookup_backend
    from torchweld.compiler.driver import CompiledGraph

    gm = torch.fx.symbolic_trace(lambda a, b: a * b + 1)
    with torch.no_grad():
        assert isinstance(lookup_backend("weld")(gm, [torch.randn(4), torch.randn(4)]), CompiledGraph)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_in_place_ops_on_memory_their_argument_shares_in_part_raise_as_eager(grad):
    """Fuzz case 33000141: `y = x[0]; x.add_(y)` raises in eager (aten's memory-overlap check:
    "some elements of the input tensor and the written-to tensor refer to a single memory
    location"); weld computed it. Such a graph runs as captured. A whole overlap (x.add_(x))
    and none (x[0].copy_(x[1])) run weld's kernels, as eager's run."""
    cases = {"x.add_(x[0])": (lambda x: x.add_(x[0]), True), "x[1:].mul_(x[:-1])": (lambda x: x[1:].mul_(x[:-1]), True),
             "x[:2].copy_(x[1:])": (lambda x: x[:2].copy_(x[1:]), True), "x.add_(x)": (lambda x: x.add_(x), False),
             "x[0].copy_(x[1])": (lambda x: x[0].copy_(x[1]), False)}
    for name, (fn, raises) in cases.items():
        torchweld.reset()
        compiled = torchweld.compile(lambda x: fn(x * 1) * 2)
        for call in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(call), requires_grad=grad)
            if raises:
                for f in (compiled, lambda x: fn(x * 1) * 2):
                    with pytest.raises(RuntimeError, match="refer to a single memory location"):
                        f(x)
            else:
                torch.testing.assert_close(compiled(x), fn(x * 1) * 2, msg=name)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_in_place_results_the_written_tensor_cannot_hold_raise_as_eager(grad):
    """Fuzz case 34000350: `int_tensor.mul_(0.5)` raises in eager ("result type Float can't be cast
    to the desired output type Long"); weld truncated into it. fill_ and copy_ cast, as eager's do."""
    w = torch.ones(4, requires_grad=grad)
    cases = {"mul_(0.5)": (lambda t: t.mul_(0.5), True), "div_(2)": (lambda t: t.div_(2), True),
             "add_(float tensor)": (lambda t: t.add_(torch.full((4,), 0.5)), True),
             "mul_(3)": (lambda t: t.mul_(3), False), "fill_(0.5)": (lambda t: t.fill_(0.5), False),
             "copy_(float)": (lambda t: t.copy_(torch.full((4,), 2.5)), False)}
    for name, (write, raises) in cases.items():
        torchweld.reset()

        def fn(x, n):
            write(n[1:])
            return x * w, n

        compiled = torchweld.compile(fn)
        for call in range(2):
            make = lambda: (torch.full((4,), 1.5 + call), torch.arange(5) - call)  # noqa: E731
            if raises:
                for f in (compiled, fn):
                    with pytest.raises(RuntimeError, match="can't be cast"):
                        f(*make())
            else:
                torch.testing.assert_close(compiled(*make()), fn(*make()), msg=name)
