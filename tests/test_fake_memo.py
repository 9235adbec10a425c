"""fake_memo replays fake-tensor results from their metadata: what it returns, on a first
call and on a repeat, is what FakeTensorMode returns, views alias their base, and calls it
cannot describe go through FakeTensorMode unchanged."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from torchweld import fake_memo

aten = torch.ops.aten


def metadata(t):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, type(t))


def same_storage(a, b):
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def fake(mode, *shape, dtype=torch.float32, device="cpu"):
    return FakeTensor(mode, torch.empty(*shape, dtype=dtype, device="meta"), torch.device(device))


CALLS = [
    ("add broadcast", aten.add.Tensor, lambda m: (fake(m, 4, 6), fake(m, 6)), {}),
    ("mul int scalar", aten.mul.Tensor, lambda m: (fake(m, 4, 6, dtype=torch.int64), 2), {}),
    ("mul float scalar", aten.mul.Tensor, lambda m: (fake(m, 4, 6, dtype=torch.int64), 2.0), {}),
    ("mul bool scalar", aten.mul.Tensor, lambda m: (fake(m, 4, 6, dtype=torch.int64), True), {}),
    ("sum dims", aten.sum.dim_IntList, lambda m: (fake(m, 4, 6, 8), [0, 2], True), {}),
    ("var_mean tuple", aten.var_mean.correction, lambda m: (fake(m, 4, 6), [1]), {"correction": 0, "keepdim": True}),
    ("cat list", aten.cat.default, lambda m: ([fake(m, 2, 3), fake(m, 5, 3)],), {}),
    ("to dtype", aten._to_copy.default, lambda m: (fake(m, 3, 3),), {"dtype": torch.float16}),
    ("cuda device", aten.exp.default, lambda m: (fake(m, 3, 5, device="cuda"),), {}),
    ("mm of transposed", aten.mm.default, lambda m: (fake(m, 6, 4).t(), fake(m, 6, 3)), {}),
]


@pytest.mark.parametrize("name,func,make_args,kwargs", CALLS, ids=[c[0] for c in CALLS])
def test_fresh_results_match_fake_tensor_mode(name, func, make_args, kwargs):
    with FakeTensorMode() as mode:
        args = make_args(mode)
        expected = func(*args, **kwargs)
        first = fake_memo.run(func, args, kwargs)
        repeat = fake_memo.run(func, args, kwargs)
    flat = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    for want, got_first, got_repeat in zip(flat(expected), flat(first), flat(repeat)):
        assert metadata(got_first) == metadata(want) == metadata(got_repeat)
        assert got_repeat.fake_mode is mode
        assert not same_storage(got_repeat, got_first)  # a fresh tensor each call


VIEWS = [
    ("transpose", aten.t.default, lambda x: (x,)),
    ("slice", aten.slice.Tensor, lambda x: (x, 1, 2, 5)),
    ("select", aten.select.int, lambda x: (x, 0, 3)),
    ("expand", aten.expand.default, lambda x: (x[:, :1], [3, 8, 6])),
    ("view", aten.view.default, lambda x: (x, [2, 4, 6])),
]


@pytest.mark.parametrize("name,func,make_args", VIEWS, ids=[v[0] for v in VIEWS])
def test_views_alias_their_base(name, func, make_args):
    with FakeTensorMode() as mode:
        base = fake(mode, 8, 6)
        args = make_args(base)
        expected = func(*args)
        fake_memo.run(func, args, {})
        repeat = fake_memo.run(func, args, {})
        assert metadata(repeat) == metadata(expected)
        assert same_storage(repeat, args[0])


LISTS_OF_VIEWS = [
    ("split", aten.split.Tensor, lambda x: (x, 3)),
    ("split_with_sizes", aten.split_with_sizes.default, lambda x: (x, [2, 5, 1])),
    ("unbind", aten.unbind.int, lambda x: (x, 1)),
]


@pytest.mark.parametrize("name,func,make_args", LISTS_OF_VIEWS, ids=[v[0] for v in LISTS_OF_VIEWS])
def test_lists_of_views_alias_their_base(name, func, make_args, monkeypatch):
    """split, unbind: a repeat is a list (as FakeTensorMode's) of views of the first argument,
    each at its offset, without dispatching again."""
    with FakeTensorMode() as mode:
        base = fake(mode, 8, 6)
        args = make_args(base)
        expected = func(*args)
        fake_memo.run(func, args, {})
        dispatched = []
        original = FakeTensorMode.__torch_dispatch__
        monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                            lambda self, *a, **k: dispatched.append(a[0]) or original(self, *a, **k))
        repeat = fake_memo.run(func, args, {})
        monkeypatch.undo()
        assert all(op is torch.ops.prim.device.default for op in dispatched), dispatched
        assert type(repeat) is type(expected) is list and len(repeat) == len(expected) > 1
        assert [metadata(t) for t in repeat] == [metadata(t) for t in expected]
        assert all(same_storage(t, base) for t in repeat)


def test_constants_take_part_only_beside_another_fake():
    """A fake standing for a constant (torch.tensor([]) made in the frame: an empty cache's
    start) is described by its metadata where another argument is not a constant, and the
    result is no constant; a call of constants alone, and a view of one, go through
    FakeTensorMode, which computes their values."""
    with FakeTensorMode() as mode:
        empty, x = torch.tensor([]), fake(mode, 4, 6)
        assert empty.constant is not None
        before = len(fake_memo._results)
        for _ in range(2):
            out = fake_memo.run(aten.cat.default, ([empty, x.flatten()],), {})
            assert metadata(out) == ((24,), (1,), 0, torch.float32, torch.device("cpu"), FakeTensor)
            assert out.constant is None
        assert len(fake_memo._results) == before + 1
        one = torch.tensor([1.0])  # (FakeTensorMode computes constants of one element at most)
        fake_memo.run(aten.add.Tensor, (fake(mode, 1), fake(mode, 1)), {})  # remembered: the same key
        fake_memo.run(aten.view.default, (fake(mode, 1), [1, 1]), {})
        for _ in range(2):
            both = fake_memo.run(aten.add.Tensor, (one, one), {})
            assert both.constant is not None and both.constant.tolist() == [2.0]
            view = fake_memo.run(aten.view.default, (one, [1, 1]), {})
            assert view.constant is not None and view.constant.tolist() == [[1.0]]
        assert len(fake_memo._results) == before + 3


def test_calls_it_cannot_describe_go_through_fake_tensor_mode():
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = fake(mode, 4, 4)
        for _ in range(2):
            assert fake_memo.run(aten.add_.Tensor, (x, 1.0), {}) is x  # in place: the input itself
            real = torch.ones(4)  # a real tensor argument is not described
            assert metadata(fake_memo.run(aten.mul.Tensor, (x, real), {})) == metadata(aten.mul.Tensor(x, real))


def test_a_repeat_skips_fake_tensor_mode(monkeypatch):
    """The point of the memo: a call seen before is not dispatched again."""
    with FakeTensorMode() as mode:
        x = fake(mode, 16, 32)
        fake_memo.run(aten.relu.default, (x,), {})
        calls = []
        original = FakeTensorMode.__torch_dispatch__
        monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                            lambda self, *a, **k: calls.append(a[0]) or original(self, *a, **k))
        out = fake_memo.run(aten.relu.default, (x,), {})
        assert calls == [] and metadata(out) == metadata(x)


def symbolic_fake(mode, *shape):
    """A fake of `shape` whose sizes above 1 are symbols of `mode`'s ShapeEnv."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    dims = [DimDynamic.DYNAMIC if n > 1 else DimDynamic.STATIC for n in shape]
    return mode.from_tensor(torch.empty(*shape), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def test_symbolic_sizes_replay_per_shape_env(monkeypatch):
    """Fakes of symbolic sizes: a repeat gives FakeTensorMode's sizes, strides, offset and
    storage size (the same expressions), a fresh tensor or a view of its base, without
    dispatching again and without a guard of its own (fake_memo._rebuild builds them with
    as_strided); another ShapeEnv's fakes, whose symbols may share names, are not given the
    first one's results."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def calls_of(mode):
        x = symbolic_fake(mode, 4, 6)
        with mode:
            return x, [(aten.mul.Tensor, (x, 2), {}), (aten.sum.dim_IntList, (x, [1]), {}),
                       (aten.view.default, (x, [x.shape[1], x.shape[0]]), {}), (aten.t.default, (x,), {}),
                       (aten.slice.Tensor, (x, 0, 1), {}), (aten.cat.default, ([x, x], 1), {})]

    modes = [FakeTensorMode(shape_env=ShapeEnv()) for _ in range(2)]
    for mode in modes:
        x, calls = calls_of(mode)
        with mode:
            firsts = [fake_memo.run(f, a, k) for f, a, k in calls]
        dispatched = []
        original = FakeTensorMode.__torch_dispatch__
        monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                            lambda self, *a, **k: dispatched.append(a[0]) or original(self, *a, **k))
        guards = len(mode.shape_env.guards)
        with mode:
            repeats = [fake_memo.run(f, a, k) for f, a, k in calls]
        monkeypatch.undo()
        assert all(op in (torch.ops.prim.device.default,) for op in dispatched), dispatched
        assert len(mode.shape_env.guards) == guards
        for (func, args, _), first, repeat in zip(calls, firsts, repeats):
            assert [str(n) for n in repeat.shape] == [str(n) for n in first.shape]
            assert [str(n) for n in repeat.stride()] == [str(n) for n in first.stride()]
            assert str(repeat.storage_offset()) == str(first.storage_offset())
            assert str(repeat.untyped_storage().nbytes()) == str(first.untyped_storage().nbytes())
            for out in (first, repeat):
                assert out.fake_mode is mode and all(
                    n.node.shape_env is mode.shape_env for n in out.shape if isinstance(n, torch.SymInt))
            if func in (aten.view.default, aten.t.default, aten.slice.Tensor):
                assert same_storage(repeat, x)
            else:
                assert not same_storage(repeat, first)


def test_in_place_ops_are_remembered_as_returning_their_input(monkeypatch):
    """x.relu_() and x.add_(y) give back x, unchanged in layout: a repeat returns x without
    dispatching; an in-place call that fails (a float added into an int tensor) fails every
    time; ops that change their input's layout (resize_) or write other arguments are not
    remembered."""
    with FakeTensorMode() as mode:
        x, y = fake(mode, 4, 6), fake(mode, 6)
        ints = fake(mode, 4, 6, dtype=torch.int64)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="not possible|can.t be cast"):
                fake_memo.run(aten.add_.Tensor, (ints, x), {})
        assert fake_memo.run(aten.add_.Tensor, (x, y), {}) is x
        assert fake_memo.run(aten.relu_.default, (x,), {}) is x
        calls = []
        original = FakeTensorMode.__torch_dispatch__
        monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                            lambda self, *a, **k: calls.append(a[0]) or original(self, *a, **k))
        assert fake_memo.run(aten.add_.Tensor, (x, y), {}) is x
        assert fake_memo.run(aten.relu_.default, (x,), {}) is x
        assert calls == []
        z = fake(mode, 4, 6)
        for _ in range(2):
            assert tuple(fake_memo.run(aten.resize_.default, (z, [8, 8]), {}).shape) == (8, 8)
        assert calls.count(aten.resize_.default) == 2
    assert fake_memo._kind(aten.resize_.default) is None and fake_memo._kind(aten.add.out) is None
    assert fake_memo._kind(aten._native_batch_norm_legit.default) is None  # writes the running statistics


def test_exported_results_are_replayed_after_forget(monkeypatch):
    """What export() gives (the ops by name) absorb() takes back, in this process or another:
    the calls are then replayed without dispatching. Entries of unknown ops or of another shape
    are skipped."""
    fake_memo.forget()
    with FakeTensorMode() as mode:
        x = fake(mode, 5, 7)
        calls = [(aten.exp.default, (x,), {}), (aten.t.default, (x,), {}), (aten.relu_.default, (x,), {})]
        firsts = [fake_memo.run(f, a, k) for f, a, k in calls]
    exported = fake_memo.export()
    assert fake_memo.unsaved() == 0 and len(exported) == 3 and all(isinstance(k[0], str) for k in exported)
    fake_memo.forget()
    junk = {("aten.no_such_op.default", 1): (False,), ("not an op",): (False,), (): (False,), ("aten.exp.default",): 3}
    assert fake_memo.absorb({**exported, **junk}) == 3
    mode = FakeTensorMode()
    x = fake(mode, 5, 7)
    dispatched = []
    original = FakeTensorMode.__torch_dispatch__
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                        lambda self, *a, **k: dispatched.append(a[0]) or original(self, *a, **k))
    with mode:
        repeats = [fake_memo.run(f, (x,), {}) for f, _, _ in calls]
    assert dispatched == []
    assert [metadata(r)[:4] for r in repeats] == [metadata(f)[:4] for f in firsts]
    assert same_storage(repeats[1], x) and repeats[2] is x
    fake_memo.forget()


def test_export_learned_only_leaves_out_what_absorb_gave():
    fake_memo.forget()
    with FakeTensorMode() as mode:
        x = fake(mode, 3, 5)
        fake_memo.run(aten.exp.default, (x,), {})
    read = fake_memo.export()
    fake_memo.forget()
    assert fake_memo.absorb(read) == 1
    with FakeTensorMode() as mode:
        y = fake(mode, 2, 9)
        fake_memo.run(aten.exp.default, (y,), {})
    assert len(fake_memo.export()) == 2
    learned = fake_memo.export(learned_only=True)
    assert len(learned) == 1 and next(iter(learned))[3][1] == (2, 9)
    fake_memo.forget()


def test_a_rebuilt_view_leaves_the_mode_unmarked():
    """A view's rebuild runs the meta kernel through this thread's dispatch keys alone: it does
    not mark the mode as inside a kernel, which another compile thread using the mode would see
    (FakeTensorMode asserts that mark and the thread's keys agree)."""
    class Watched(FakeTensorMode):
        marks = 0

        @property
        def in_kernel_invocation(self):
            return self.__dict__.get("_in_kernel", False)

        @in_kernel_invocation.setter
        def in_kernel_invocation(self, value):
            type(self).marks += bool(value)
            self.__dict__["_in_kernel"] = value

    with Watched() as mode:
        x = fake(mode, 8, 6)
        first = fake_memo.run(aten.t.default, (x,), {})  # through FakeTensorMode, which marks it
        before = Watched.marks
        repeat = fake_memo.run(aten.t.default, (x,), {})
        assert Watched.marks == before
        assert metadata(repeat) == metadata(first) and same_storage(repeat, x)
