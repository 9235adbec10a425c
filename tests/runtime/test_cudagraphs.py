"""CUDA-graph runtime: when to record, static buffers, new layouts, output safety,
the shared pool and fallback reasons, on the CPU through FakeRecorder; the real
CUDA path at the end (skipped without a GPU)."""
import logging

import pytest
import torch
import torch.nn as nn

import torchweld
from graph_fakes import FakeRecorder
from torchweld.runtime.cudagraphs import CudaGraphed, CudaGraphPool, graph_reason, mutated_placeholders, pool_for
from torchweld.tuning import tuning


def graphed(fn, recorder=None, **kw):
    return CudaGraphed(fn, pool=CudaGraphPool(recorder or FakeRecorder()), **kw)


def f(x, y):
    return {"a": x.sin() + y, "b": [x * 2]}


def test_warm_up_then_record_then_replay():
    g = graphed(f)
    y = torch.randn(4)
    for _ in range(4):
        x = torch.randn(4)
        torch.testing.assert_close(g(x, y), f(x, y))
    rec = g.pool.recorder
    assert (rec.warm_ups, len(rec.records), rec.replays) == (1, 1, 4)  # the first call replays too


def test_warm_up_results_are_dropped_before_recording():
    # held, they would sit beside the recording's own outputs: the first call's peak memory
    g = graphed(f, outputs="track")
    x, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(g(x, y), f(x, y))
    assert g.pool.recorder.warm_up_outputs_alive == [0]


def test_copied_outputs_stay_valid():
    g = graphed(f)
    x1, x2, y = torch.randn(4), torch.randn(4), torch.randn(4)
    g(x1, y)
    first = g(x1, y)  # a replay
    g(x2, y)  # overwrites the static outputs
    torch.testing.assert_close(first, f(x1, y))


def test_tracked_outputs_stay_valid_and_dead_ones_are_reused():
    g = graphed(f, outputs="track", max_instances=3)
    y = torch.randn(4)
    xs = [torch.randn(4) for _ in range(8)]
    g(xs[0], y)  # warm-up + one recording
    held = g(xs[1], y)["a"][1:]  # a view of a replay's output, held
    g(xs[2], y)  # the first recording's outputs are alive: a second recording
    torch.testing.assert_close(held, f(xs[1], y)["a"][1:])
    assert len(g.pool.recorder.records) == 2
    del held
    for x in xs:  # y = g(x) in a loop: two recordings alternate
        out = g(x, y)
        torch.testing.assert_close(out, f(x, y))
    assert len(g.pool.recorder.records) == 2
    kept = [g(x, y) for x in xs]  # all held: past max_instances the outputs are copied
    for x, out in zip(xs, kept):
        torch.testing.assert_close(out, f(x, y))
    assert len(g.pool.recorder.records) == 4  # 3 tracked recordings + 1 that copies out


def test_new_shape_or_dtype_is_a_new_graph():
    g = graphed(lambda x: x * 3)
    for x in (torch.randn(4), torch.randn(5), torch.randn(4).double(), torch.randn(4), torch.randn(5)):
        torch.testing.assert_close(g(x), x * 3)
    assert len(g.pool.recorder.records) == 3


def test_parameters_are_read_in_place_and_a_moved_one_records_again():
    lin = nn.Linear(3, 2)
    g = graphed(lambda x, w, b: torch.nn.functional.linear(x, w, b), static_input_indices=[2])
    x = torch.randn(5, 3)
    g(x, lin.weight, lin.bias)
    with torch.no_grad():
        lin.weight.mul_(2)  # same storage: the recorded graph sees it
        torch.testing.assert_close(g(x, lin.weight, lin.bias), lin(x))
        assert len(g.pool.recorder.records) == 1
        old = lin.weight
        lin.weight = nn.Parameter(torch.randn(2, 3))  # new storage: record again
        torch.testing.assert_close(g(x, lin.weight, lin.bias), lin(x))
        assert len(g.pool.recorder.records) == 2
        lin.weight = old  # back where the first recording reads it: replayed, not recorded
        torch.testing.assert_close(g(x, lin.weight, lin.bias), lin(x))
    assert len(g.pool.recorder.records) == 2
    # static inputs are read by address: the recordings keep no reference to them
    instances = g.layouts[next(iter(g.layouts))].instances
    assert all(inst.inputs[1] is None and inst.inputs[2] is None for inst in instances)


def test_static_inputs_are_not_part_of_the_layout_key():
    """The key is built at every call: static inputs (densenet121's train step has
    ~1200) are left out; one that moves to a new layout is recorded again through `_moved`."""
    g = graphed(lambda x, w: x * w, static_input_indices=[1])
    x, w = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(g(x, w), x * w)
    (key,) = g.layouts
    assert len(key) == 1  # x alone
    w64 = torch.randn(3, dtype=torch.float64)  # a parameter converted in place: new storage
    torch.testing.assert_close(g(x, w64), x * w64)
    assert len(g.layouts) == 1 and len(g.pool.recorder.records) == 2


def test_static_inputs_that_move_at_every_call_run_without_graphs(caplog):
    g = graphed(lambda x, w: x * w, static_input_indices=[1], max_instances=2)
    x = torch.randn(3)
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        weights = [torch.randn(3) for _ in range(20)]  # all alive: each at its own address
        for w in weights:
            torch.testing.assert_close(g(x, w), x * w)
    assert len(g.pool.recorder.records) <= 8
    assert "move between calls" in caplog.text


def test_mutated_inputs_are_copied_back():
    def bump(x):
        x.add_(1)
        return x * 2

    gm = torch.fx.symbolic_trace(bump)
    assert mutated_placeholders(gm) == [0]
    g = graphed(gm.forward, mutated_input_indices=mutated_placeholders(gm))
    x, ref = torch.zeros(3), torch.zeros(3)
    for _ in range(3):
        torch.testing.assert_close(g(x), bump(ref))
        torch.testing.assert_close(x, ref)


def test_inputs_written_by_a_foreach_op_are_copied_back():
    """An optimizer step writes lists of inputs (torch._foreach_add_): each is mutated."""
    def bump(a, b, c):
        torch._foreach_add_([a, b], 1)
        return c * 2

    gm = torch.fx.symbolic_trace(bump)
    assert mutated_placeholders(gm) == [0, 1]
    g = graphed(gm.forward, mutated_input_indices=mutated_placeholders(gm))
    inputs, refs = [torch.zeros(3) for _ in range(3)], [torch.zeros(3) for _ in range(3)]
    for _ in range(3):
        torch.testing.assert_close(g(*inputs), bump(*refs))
        for x, ref in zip(inputs, refs):
            torch.testing.assert_close(x, ref)


def test_mutation_through_a_view_and_inplace_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x, y, z):
            x.view(-1)[0].mul_(2)
            self.relu(y)
            return z + 1

    assert mutated_placeholders(torch.fx.symbolic_trace(M())) == [0, 1]


def test_graphs_of_one_model_share_one_pool():
    recorder = FakeRecorder()
    options = {"cudagraph_pool": CudaGraphPool(recorder)}
    a = CudaGraphed(lambda x: x + 1, pool=pool_for(options))
    b = CudaGraphed(lambda x: x - 1, pool=pool_for(options))
    for x in (torch.randn(3), torch.randn(3), torch.randn(4)):
        a(x), b(x)
    assert len(recorder.pools) == 1 and len(recorder.records) == 4
    assert all(p is recorder.pools[0] for p in recorder.records)
    assert pool_for({}) is not options["cudagraph_pool"]


def test_tracked_recordings_get_pools_of_their_own():
    """Memory another graph's recording used as scratch may be where a later recording
    puts its outputs; a handed-out (tracked) output must not lie there, or that graph's
    replay overwrites what the user holds."""
    recorder = FakeRecorder()
    options = {"cudagraph_pool": CudaGraphPool(recorder)}
    step = CudaGraphed(lambda x: x * 2, pool=pool_for(options))
    forward = CudaGraphed(lambda x: x + 1, pool=pool_for(options), outputs="track")
    x = torch.randn(3)
    held = [forward(x), step(x), forward(x)]  # the first output is held: a second recording
    shared = options["cudagraph_pool"].handle
    assert recorder.records.count(shared) == 1  # the copying graph only
    assert len(set(map(id, recorder.records))) == 3
    torch.testing.assert_close(held[2], x + 1)


def test_cpu_tensors_run_without_graphs_and_say_why_once(caplog):
    g = graphed(lambda x: x + 1, FakeRecorder(device_type="cuda"))
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        for _ in range(3):
            x = torch.randn(3)
            torch.testing.assert_close(g(x), x + 1)
    msgs = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert len(msgs) == 1 and "input 0 is a CPU tensor" in msgs[0]
    assert g.pool.recorder.records == []


def test_synchronizing_op_is_found_in_the_graph():
    gm = torch.fx.symbolic_trace(lambda x: x.nonzero())
    assert "nonzero() synchronizes" in graph_reason(gm, "cpu")
    assert graph_reason(torch.fx.symbolic_trace(lambda x: x + 1), "cpu") is None
    assert "CPU tensor" in graph_reason(torch.fx.symbolic_trace(nn.Linear(3, 3)), "cuda")


def test_repeat_interleave_synchronizes_only_with_tensor_repeats():
    """An int repeats (grouped-query attention's heads over a KV cache) is an expand and a copy:
    recorded. A tensor of repeats has a data-dependent size."""
    assert graph_reason(torch.fx.symbolic_trace(lambda k: k.repeat_interleave(4, dim=1)), "cpu") is None
    assert graph_reason(torch.fx.symbolic_trace(lambda k: torch.repeat_interleave(k, repeats=2)), "cpu") is None
    assert "repeat_interleave() synchronizes" in graph_reason(
        torch.fx.symbolic_trace(lambda k, r: k.repeat_interleave(r, dim=0)), "cpu")
    assert "repeat_interleave() synchronizes" in graph_reason(
        torch.fx.symbolic_trace(lambda r: torch.repeat_interleave(r)), "cpu")


def test_recording_failure_runs_eagerly(caplog):
    rec = FakeRecorder(fail_with=RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    g = graphed(lambda x: x + 1, rec)
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        for _ in range(3):
            x = torch.randn(3)
            torch.testing.assert_close(g(x), x + 1)
    assert sum("operation not permitted" in r.getMessage() for r in caplog.records) == 1


def test_recording_failure_after_a_mutating_warm_up_returns_its_result():
    # the warm-up did the call's writes: its result is returned, not a second run's
    rec = FakeRecorder(fail_with=RuntimeError("recording failed"))
    calls = []

    def bump(x):
        calls.append(1)
        x.add_(1)
        return x * 2

    g = graphed(bump, rec, mutated_input_indices=[0])
    x = torch.zeros(3)
    torch.testing.assert_close(g(x), torch.full((3,), 2.0))
    torch.testing.assert_close(x, torch.ones(3))
    assert len(calls) == 1


def test_too_many_layouts_is_dynamic(caplog):
    g = graphed(lambda x: x + 1)
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        for n in range(1, tuning.max_layouts + 3):
            torch.testing.assert_close(g(torch.ones(n)), torch.ones(n) + 1)
    assert len(g.pool.recorder.records) == tuning.max_layouts
    assert any("dynamic sizes" in r.getMessage() for r in caplog.records)


# -- through torchweld.compile ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["cudagraphs", "weld"])
def test_a_graph_with_symbolic_sizes_is_recorded_per_size(backend):
    """As torch.compile's CUDA graph trees: a dynamic graph (automatic dynamic, from the second
    size on) records one graph per concrete size, and replays each (weld from a size's second
    call, which compiles it: backends/weld_sizes.py)."""
    rec = FakeRecorder()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    fast = torchweld.compile(model, backend=backend, mode="reduce-overhead",
                             options={"cudagraph_pool": CudaGraphPool(rec)})
    with torch.no_grad():
        for n in (4, 6, 4, 6, 5, 5, 6):
            x = torch.randn(n, 8)
            torch.testing.assert_close(fast(x), model(x))
    assert len(rec.records) == 3 and rec.replays >= 3


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2 + 1


def test_cudagraphs_backend_records_the_eager_graph():
    rec = FakeRecorder()
    model = Small()
    fast = torchweld.compile(model, backend="cudagraphs", options={"cudagraph_pool": CudaGraphPool(rec)})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(fast(x), model(x))
    assert len(rec.records) == 1 and rec.replays == 3


def test_cudagraphs_backend_leaves_training_graphs_eager(caplog):
    rec = FakeRecorder()
    model = Small()
    fast = torchweld.compile(model, backend="cudagraphs", options={"cudagraph_pool": CudaGraphPool(rec)})
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        x = torch.randn(4, 8)
        fast(x).sum().backward()
    assert rec.records == [] and model.lin.weight.grad is not None
    assert any("needs autograd" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode, options, expect", [
    (None, {}, False), ("default", {}, False), ("reduce-overhead", {}, True), ("max-autotune", {}, True),
    ("max-autotune-no-cudagraphs", {}, False), (None, {"cudagraphs": True}, True),
    ("reduce-overhead", {"cudagraphs": False}, False),
])
def test_modes_decide_cudagraphs(mode, options, expect):
    from torchweld.backends.weld import autotune_enabled, cudagraphs_enabled

    assert cudagraphs_enabled(mode, options) is expect
    assert autotune_enabled(mode, options) is (mode in ("max-autotune", "max-autotune-no-cudagraphs"))


def test_weld_reduce_overhead_on_a_fake_recorder():
    rec = FakeRecorder()

    def fn(x, y):
        return torch.tanh(x) * y + 1, (x * y).sum(0)

    fast = torchweld.compile(fn, backend="weld", mode="reduce-overhead",
                             options={"cudagraph_pool": CudaGraphPool(rec)})
    y = torch.randn(5)
    outs = []
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 5)
            outs.append((x, fast(x, y)))
        for x, out in outs:
            torch.testing.assert_close(out, fn(x, y))
    assert len(rec.records) == 1 and rec.replays == 3


def test_weld_default_mode_never_records():
    rec = FakeRecorder()
    fast = torchweld.compile(lambda x: x + 1, backend="weld", options={"cudagraph_pool": CudaGraphPool(rec)})
    with torch.no_grad():
        for _ in range(2):
            fast(torch.randn(3))
    assert rec.records == [] and rec.warm_ups == 0


# -- real CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_graphs_share_one_side_stream_and_its_cublas_workspace():
    # cuBLAS keeps a workspace per stream it has run on: a fresh stream per warm-up allocated
    # another one (MiBs) for each graph recorded
    from torchweld.runtime.cudagraphs import CudaGraphRecorder
    pool = CudaGraphPool(CudaGraphRecorder())
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    first = CudaGraphed(torch.mm, pool=pool)
    torch.testing.assert_close(first(a, b), a @ b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    second = CudaGraphed(torch.mm, pool=CudaGraphPool(CudaGraphRecorder()))
    out = second(a, b)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a @ b)
    # static input buffers, the recording's output and the copy handed out: 64 KiB in all
    assert torch.cuda.memory_allocated() - before < 2 ** 20


@cuda
def test_cuda_graphs_keep_no_cublas_workspace_allocated():
    # cuBLAS's workspace (32 MiB a stream on the H100) is let go of after each warm-up and
    # recording, as CUDA graph trees do: kept, it sat beside the activations at every later
    # warm-up's and recording's peak (resnet50's inference: 33 MiB of its 388)
    from torchweld.runtime.cudagraphs import CudaGraphRecorder
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    expected = a @ b  # eager, on this stream: its own workspace, let go of too
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    g = CudaGraphed(torch.mm, pool=CudaGraphPool(CudaGraphRecorder()))
    for _ in range(3):
        torch.testing.assert_close(g(a, b), expected)
    torch.cuda.synchronize()
    # static input buffers, the recording's output and the copy handed out: 64 KiB in all
    assert torch.cuda.memory_allocated() - before < 2 ** 20
    torch.testing.assert_close(g(a + 1, b), (a + 1) @ b)  # the graph's workspace still lies in its pool


@cuda
@pytest.mark.parametrize("backend", ["weld", "cudagraphs"])
@pytest.mark.parametrize("outputs", ["copy", "track"])
def test_cuda_reduce_overhead_matches_eager(backend, outputs):
    model = Small().cuda()
    from torchweld.runtime.cudagraphs import CudaGraphRecorder
    pool = CudaGraphPool(CudaGraphRecorder())
    options = {"cudagraph_outputs": outputs, "cudagraph_pool": pool}
    fast = torchweld.compile(model, backend=backend, mode="reduce-overhead", options=options)
    with torch.no_grad():
        xs = [torch.randn(4, 8, device="cuda") for _ in range(4)] + [torch.randn(6, 8, device="cuda")]
        outs = [fast(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x))
    assert pool.graphs_recorded >= 2
    assert (pool.handle is None) == (outputs == "track")  # tracked recordings have pools of their own


@cuda
def test_cuda_sync_op_falls_back(caplog):
    def fn(x):  # a copy to the host inside the graph: capture keeps it, a CUDA graph cannot hold it
        return (x * 2).cpu() + 1

    fast = torchweld.compile(fn, backend="cudagraphs", mode="reduce-overhead")
    with caplog.at_level(logging.INFO, logger="torchweld.weld"):
        for _ in range(3):
            x = torch.randn(16, device="cuda")
            torch.testing.assert_close(fast(x), fn(x))
    assert any("without CUDA graphs" in r.getMessage() for r in caplog.records)


@cuda
def test_cuda_mutated_input_and_static_parameter():
    def fn(x, w):
        x.mul_(2)
        return x @ w

    w = nn.Parameter(torch.randn(8, 8, device="cuda"), requires_grad=False)
    fast = torchweld.compile(fn, backend="cudagraphs", mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        ref = x.clone()
        out = fast(x, w)
        torch.testing.assert_close(out, fn(ref, w))
        torch.testing.assert_close(x, ref)


def test_training_plug_in_wrapper_records_into_the_models_pools():
    from torchweld.backends.weld import cudagraph_wrapper

    rec = FakeRecorder()
    options = {"cudagraph_pool": CudaGraphPool(rec)}
    assert cudagraph_wrapper(None, options) is None
    wrap = cudagraph_wrapper("reduce-overhead", options)
    w = nn.Parameter(torch.randn(3))
    fwd = wrap(lambda w, x: (x * w, x.sin()), "forward", static_input_indices=[0], outputs="track")
    bwd = wrap(lambda g, s: g * s, "backward")
    for _ in range(3):
        x = torch.randn(3)
        out, saved = fwd(w, x)
        torch.testing.assert_close(out, x * w)
        torch.testing.assert_close(bwd(torch.ones(3), saved), x.sin())
    # the backward's pool; each tracked forward recording has its own. The previous `saved` is
    # alive at the second forward: two forward recordings, and the backward reads the output of
    # each in place (an output another recording handed out), so it records once for each
    shared = options["cudagraph_pool"].handle
    forward_pools = [p for p in rec.records if p is not shared]
    assert len(forward_pools) == len(set(map(id, forward_pools))) == 2 and rec.records.count(shared) == 2


def test_outputs_another_recording_hands_out_are_read_in_place():
    """A graph fed the outputs another recording handed out (a compiled step's optimizer
    reading the gradients its backward handed out) reads them where they lie: no static copy,
    no place in the layout key where the capture's guards check layouts, and an output that
    is a view of one does not keep the other recording busy."""
    pool = CudaGraphPool(FakeRecorder())
    grads = CudaGraphed(lambda x: (x * 2, x + 1), pool=pool, name="backward", outputs="track")
    step = CudaGraphed(lambda g, h, lr: (g * lr + h, g.view(-1)[:2]), pool=pool, name="optimizer", guarded=True)
    for i in range(4):
        x = torch.randn(3, 2) + i
        g, h = grads(x)
        out, view = step(g, h, torch.tensor(0.5))
        torch.testing.assert_close(out, x * 2 * 0.5 + x + 1)
        torch.testing.assert_close(view, (x * 2).view(-1)[:2])
        del g, h, out, view
    (instance,) = [inst for layout in step.layouts.values() for inst in layout.instances]
    assert step.adopted == {0, 1} and instance.copied == [2]
    assert step._keyed(3) == (2,)
    assert pool.graphs_recorded == 2  # each graph once: the view handed out is not held by the recording


def test_an_adopted_input_that_moves_is_recorded_for_its_new_place():
    pool = CudaGraphPool(FakeRecorder())
    first = CudaGraphed(lambda x: (x * 2,), pool=pool, outputs="track")
    second = CudaGraphed(lambda x: (x * 2,), pool=pool, outputs="track")
    step = CudaGraphed(lambda g: (g + 1,), pool=pool, guarded=True)
    x = torch.randn(4)
    (g,) = first(x)
    torch.testing.assert_close(step(g)[0], x * 2 + 1)
    (g,) = second(x + 1)  # lies elsewhere: the step records again, for that place
    torch.testing.assert_close(step(g)[0], (x + 1) * 2 + 1)
    (g,) = first(x - 1)
    torch.testing.assert_close(step(g)[0], (x - 1) * 2 + 1)
    assert sum(len(layout.instances) for layout in step.layouts.values()) == 2


def test_misaligned_input_warms_up_the_static_variant_too():
    g = graphed(lambda x: x * 2)
    base = torch.randn(9)
    for _ in range(3):
        x = base[1:]  # 4 bytes past an aligned pointer: a different Triton specialization
        torch.testing.assert_close(g(x), x * 2)
    assert g.pool.recorder.warm_ups == 2 and len(g.pool.recorder.records) == 1


def test_before_replay_runs_before_each_replay():
    """weld's frozen constants are refreshed before a replay: a weight updated in place
    after recording must reach the replayed graph (here: a constant the graph reads by address)."""
    weight = torch.ones(4)
    folded = weight * 2  # what freezing computes once, outside the graph

    def refresh():
        folded.copy_(weight * 2)

    g = graphed(lambda x: x * folded, before_replay=refresh)
    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(g(x), x * weight * 2)
    weight.mul_(3)
    torch.testing.assert_close(g(x), x * weight * 2)
    assert g.pool.recorder.replays >= 2


def test_compiled_training_replays_forward_and_backward_like_eager():
    """reduce-overhead training: the compiled forward and backward are recorded once each
    and replayed; saved activations are read in place, so a step records nothing new."""
    import copy

    from torchweld.autograd import compile_training
    from torchweld.backends.weld import cudagraph_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4)).train()
    ref = copy.deepcopy(model)
    rec = FakeRecorder()
    wrap = cudagraph_wrapper("reduce-overhead", {"cudagraph_pool": CudaGraphPool(rec)})
    compiled = compile_training(torch.fx.symbolic_trace(model), [torch.randn(2, 3, 6, 6)], cudagraphs=wrap)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(5):
        x = torch.randn(2, 3, 6, 6)
        losses = []
        for fn, opt in ((compiled, opts[0]), (ref, opts[1])):
            opt.zero_grad(set_to_none=True)
            loss = fn(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip([*model.named_parameters(), *model.named_buffers()], [*ref.parameters(), *ref.buffers()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert len(rec.records) == 2 and rec.replays == 10  # forward + backward, each recorded once


def test_lent_outputs_are_the_recordings_own_until_the_lease_goes():
    """With lent_from, outputs past it are handed out as the static tensors themselves
    (no alias to make, no use count to read); the lease says whether they are in use."""
    g = graphed(lambda x: (x + 1, x * 2, x * 3), outputs="track", lent_from=1)
    x = torch.randn(4)
    (out, lent2, lent3), lease = g(x)
    torch.testing.assert_close((out, lent2, lent3), (x + 1, x * 2, x * 3))
    instance = g.layouts[next(iter(g.layouts))].instances[0]
    assert lent2 is instance.outputs[1] and out is not instance.outputs[0]
    y = torch.randn(4)
    (_, other2, _), other_lease = g(y)  # the first lease is held: a second recording
    assert other2 is not lent2 and len(g.pool.recorder.records) == 2
    torch.testing.assert_close(lent2, x * 2)  # the first call's lent outputs are intact
    del lease, out
    (_, again, _), _ = g(x)  # the first recording is free again
    assert again is lent2 and len(g.pool.recorder.records) == 2


def test_lending_without_a_recording_returns_no_lease():
    g = graphed(lambda x: (x + 1, x * 2), FakeRecorder(device_type="cuda"), outputs="track", lent_from=1)
    for _ in range(2):
        x = torch.randn(3)
        (a, b), lease = g(x)  # a CPU tensor cannot be recorded: the function runs as it is
        assert lease is None
        torch.testing.assert_close(b, x * 2)
    with pytest.raises(ValueError, match="lent_from"):
        graphed(lambda x: x, lent_from=0)


def _training_pair(rec):
    import copy

    from torchweld.autograd import compile_training
    from torchweld.backends.weld import cudagraph_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).train()
    ref = copy.deepcopy(model)
    wrap = cudagraph_wrapper("reduce-overhead", {"cudagraph_pool": CudaGraphPool(rec)})
    return model, ref, compile_training(torch.fx.symbolic_trace(model), [torch.randn(4, 6)], cudagraphs=wrap)


def test_two_forwards_before_one_backward_keep_their_saved_activations():
    """The first forward's saved activations are lent to its graph until its backward has
    run: the second forward must not replay over them (it records a copy of its own)."""
    rec = FakeRecorder()
    model, ref, compiled = _training_pair(rec)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    (compiled(x1).tanh().sum() + compiled(x2).square().sum()).backward()
    (ref(x1).tanh().sum() + ref(x2).square().sum()).backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    # two forward recordings, and a backward recording for the activations of each
    assert len(rec.records) == 4


def test_retained_graph_keeps_its_activations_across_a_later_forward():
    rec = FakeRecorder()
    model, ref, compiled = _training_pair(rec)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    for fn in (compiled, ref):
        loss = fn(x1).sum()  # sum's backward saves nothing: the graph alone holds x1's activations
        loss.backward(retain_graph=True)
        fn(x2).sum().backward()  # a step between the two backwards of the retained graph
        loss.backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


class _Cached(nn.Module):
    """A KV-cache-like buffer written at a position each call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, self.lin(x))
        return self.cache.sum(0)


def test_module_parameters_and_buffers_are_read_in_place_by_recordings():
    """A module's buffers, like its parameters, are static inputs of a recording (a KV cache
    is neither copied in before each replay nor back after it); the graph updates it in place."""
    from torchweld.runtime.cudagraphs import resident_placeholders

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _Cached()
    torchweld.compile(model, backend=backend)(torch.randn(1, 4), torch.tensor([0]))
    placeholders = [n.meta.get("source") for n in graphs[0].graph.nodes if n.op == "placeholder"]
    resident = {placeholders[i] for i in resident_placeholders(graphs[0])}
    assert resident == {"L['self'].cache"}  # the Linear is a leaf: its parameters live in the graph module

    rec = FakeRecorder()
    model, reference = _Cached(), _Cached()
    reference.load_state_dict(model.state_dict())
    fast = torchweld.compile(model, backend="weld", mode="reduce-overhead",
                             options={"cudagraph_pool": CudaGraphPool(rec)})
    with torch.no_grad():
        for p in (0, 3, 5, 3):
            x = torch.randn(1, 4)
            torch.testing.assert_close(fast(x, torch.tensor([p])), reference(x, torch.tensor([p])))
            torch.testing.assert_close(model.cache, reference.cache)
    assert len(rec.records) == 1 and rec.replays >= 3
    # the buffer replaced between calls (a cache reset): the recording reads the new one
    model.cache = torch.ones(8, 4)
    reference.cache = torch.ones(8, 4)
    with torch.no_grad():
        for p in (1, 6):
            x = torch.randn(1, 4)
            torch.testing.assert_close(fast(x, torch.tensor([p])), reference(x, torch.tensor([p])))
            torch.testing.assert_close(model.cache, reference.cache)
    assert len(rec.records) == 2


def test_a_residual_block_trains_under_reduce_overhead():
    """conv-bn-relu, a residual block, pooling and a linear layer (resnet's shape), compiled for
    training with CUDA graphs (the fake recorder), steps as eager's. The forward saved a view of
    fc.weight kept from its recording, whose base had been written since (the replay): its first
    backward raised 'A view was created in no_grad mode ...' (resnet50 on the H100 alike)."""
    import copy

    from torchweld.autograd import compile_training
    from torchweld.backends.weld import cudagraph_wrapper

    class Residual(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            out += x
            return torch.relu(out)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Residual(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).train()
    ref = copy.deepcopy(model)
    wrap = cudagraph_wrapper("reduce-overhead", {"cudagraph_pool": CudaGraphPool(FakeRecorder())})
    compiled = compile_training(torch.fx.symbolic_trace(model), [torch.randn(2, 3, 8, 8)], cudagraphs=wrap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(3):
        x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
        losses = []
        for fn, opt in ((compiled, opts[0]), (ref, opts[1])):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(fn(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for a, b in zip([*model.parameters(), *model.buffers()], [*ref.parameters(), *ref.buffers()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
