"""Compile a captured graph for training: trace the joint graph, partition it,
compile forward and backward with weld's inference pipeline, and return a
callable that runs them through one autograd.Function."""
from __future__ import annotations

import contextlib
import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from torchweld import gc_pause, timing
from torchweld.autograd import training_cache
from torchweld.autograd.functionalize import FunctionalizationError
from torchweld.autograd.joint import JointGraph, ModuleState, StateReader, module_state, trace_joint
from torchweld.autograd.partition import Partition, UnboundSymbol, partition
from torchweld.autograd.runtime import TrainingGraph, run
from torchweld.compiler import graph_cache
from torchweld.compiler.graph_modules import graph_module
from torchweld.runtime.autocast_off import run_without_autocast
from torchweld.runtime.input_overlap import WrittenOverlap
from torchweld.runtime.write_back import WriteBack

log = logging.getLogger("torchweld.weld")


class TrainingUnsupported(Exception):
    """This graph cannot be compiled for training; the backend runs it eagerly."""


class CompiledTrainingGraph:
    """The callable weld returns for a graph that needs autograd. `joint` and `partition` are
    None for a graph loaded from the graph cache (training_cache.py), which skipped them."""

    def __init__(self, gm: torch.fx.GraphModule, state: list[ModuleState], input_positions: list[int],
                 joint: JointGraph | None, part: Partition | None, graph: TrainingGraph, exact=None):
        self.gm, self.state, self.input_positions = gm, state, input_positions
        self.joint, self.partition, self.graph = joint, part, graph
        self.state_reader = StateReader(gm, state)
        # a graph that writes tensors in place runs `exact` (the captured graph, op by op) on a
        # call where one of them shares memory with an input (runtime/input_overlap.py)
        self.exact = exact
        self.overlap = None
        if graph.mutated_primals and exact is not None:
            self.overlap = WrittenOverlap(graph.mutated_primals,
                                          range(len(state), len(state) + len(input_positions)))

    def __call__(self, *args):
        primals = self.state_reader.read()
        primals += [args[i] for i in self.input_positions]
        if self.overlap is not None and self.overlap.found(primals):
            return self.exact(*args)
        return run(self.graph, primals)


def compile_training(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                     strategy: str | None = None, cudagraphs=None) -> CompiledTrainingGraph:
    """`cudagraphs`: None, or backends.weld.cudagraph_wrapper's `wrap`, which records the
    compiled forward and backward as CUDA graphs (mode="reduce-overhead")."""
    options = dict(options or {})
    strategy = strategy or options.get("partition", "min_cut")
    state = module_state(gm)
    if any(isinstance(x, torch.SymFloat) for x in example_inputs):
        raise TrainingUnsupported("a float argument over symbols (shortcut: compiled per size)")
    # tensors, and ints over symbols (backends/weld_symbolic.py), are the graph's inputs
    input_positions = [i for i, x in enumerate(example_inputs) if isinstance(x, (torch.Tensor, torch.SymInt))]
    primals = [s.read(gm) for s in state] + [example_inputs[i] for i in input_positions]
    exact = gm.forward
    key = training_cache.training_key(gm, example_inputs, options, strategy)  # None: not kept in the graph cache
    if len(input_positions) != len(example_inputs):
        # Other inputs are baked into the graph: capture guards their values.
        gm = _bind_constants(gm, example_inputs, input_positions)

    as_now = _grad_and_autocast_as_now()

    def trace_and_partition() -> tuple[JointGraph, Partition]:
        """Also at a loaded step's first backward, where the engine runs without grad mode:
        under the grad mode and autocast settings of the compile, which the trace reads."""
        try:
            with timing.phase("weld.joint_graph"), as_now():
                joint = trace_joint(gm, state, primals)
        except FunctionalizationError as e:
            raise TrainingUnsupported(str(e)) from e
        with timing.phase("weld.partition"):
            try:
                part = partition(joint, strategy)
            except UnboundSymbol as e:
                raise TrainingUnsupported(str(e)) from e
        log.debug("training partition (%s): saves %d tensors, %d bytes of intermediates",
                  strategy, len(part.saved), part.saved_bytes)
        return joint, part

    # gradients in their primal's layout: autograd would copy any other layout into it
    def grad_strides(grad_primals: list[int]) -> list[tuple]:
        return [tuple(primals[i].stride()) for i in grad_primals]

    def backward_in_cuda_graph(backward, saved: list[tuple[str, int]]):
        # Saved activations lie in the forward recording's memory, and module state in the
        # module: both read in place. Saved user inputs and the tangents are copied in. The
        # gradients stay valid while the user holds them (in .grad, until zero_grad).
        in_place = [i for i, (kind, j) in enumerate(saved) if kind == "forward" or j < len(state)]
        return cudagraphs(backward, "backward", static_input_indices=in_place, outputs="track")

    def forward_in_cuda_graph(forward, num_outputs: int):
        # Module state stays put between steps: read in place. The saved activations (and
        # new buffer values) a forward replay lends stay valid until its backward has run.
        return cudagraphs(forward, "forward", static_input_indices=range(len(state)), outputs="track",
                          lent_from=num_outputs)

    entry = training_cache.load(key) if key is not None else None
    if entry is not None:
        in_cuda_graphs = (forward_in_cuda_graph, backward_in_cuda_graph) if cudagraphs else (None, None)
        if over_symbols(primals):
            graph = _loaded_over_symbols(entry, primals, *in_cuda_graphs)
        else:
            graph = _cached_training_graph(entry, primals, options, trace_and_partition, grad_strides, *in_cuda_graphs)
        if graph is not None:
            return CompiledTrainingGraph(gm, state, input_positions, None, None, graph, exact)

    joint, part = trace_and_partition()
    if over_symbols(primals):
        return _compiled_over_symbols(gm, state, input_positions, joint, part, primals, options, grad_strides,
                                      exact, cudagraphs and forward_in_cuda_graph, cudagraphs and backward_in_cuda_graph,
                                      key)
    # The backward compiles in a thread, for the layouts the joint trace gives its inputs, from
    # when the forward's kernels are with the Triton compilers: its Python work overlaps their
    # compiles (not the forward's lowering, under one GIL), and its kernels queue behind them.
    # Started with the forward's lowering, on densenet121's step, it took the forward's
    # lowering, scheduling and rendering from 3.2 to 6.7 s and its kernels went to the compile
    # workers first, while the main thread waited for the forward's. (Whole first steps came
    # out within noise either way: bench/DECISIONS.md#backward-ahead.)
    assumed = [n.meta.get("val") for n in part.backward.graph.nodes if n.op == "placeholder"]
    started: list[Future | None] = []

    def start_backward() -> None:
        if not started:
            started.append(_compile_ahead(
                lambda: compile_aten(part.backward, assumed, options, "backward", grad_strides(joint.grad_primals)),
                assumed, options))

    forward = compile_aten(part.forward, primals, options, "forward", handed_over=start_backward)
    start_backward()  # where the forward handed over no Triton kernels
    ahead = started[0]
    forward_key = getattr(forward, "cache_key", None)
    if cudagraphs is not None:
        forward = forward_in_cuda_graph(forward, joint.num_outputs)

    def compile_backward(example):
        # waited for on the first backward, not at capture
        with timing.phase("weld.backward_graph"), gc_pause.paused():
            backward = _result_if_layouts_match(ahead, assumed, example)
            if backward is None:
                backward = compile_aten(part.backward, example, options, "backward", grad_strides(joint.grad_primals))
        backward_key = getattr(backward, "cache_key", None)
        if key is not None and forward_key is not None and backward_key is not None:
            training_cache.store(key, forward_key, backward_key, training_cache.layouts(example), graph)
        return backward if cudagraphs is None else backward_in_cuda_graph(backward, part.saved)

    write_back = WriteBack([primals[i].dtype for i in joint.mutated_primals])
    graph = TrainingGraph(forward, compile_backward, joint.num_outputs, joint.out_spec, joint.diff_outputs,
                          joint.mutated_primals, joint.grad_primals, part.saved, write_back,
                          forward_lends=cudagraphs is not None, input_view_outputs=joint.input_view_outputs,
                          written_primal_views=joint.written_primal_views, primal_outputs=joint.primal_outputs,
                          primal_views=joint.primal_views, enables_grad=not torch.is_grad_enabled())
    return CompiledTrainingGraph(gm, state, input_positions, joint, part, graph, exact)


def over_symbols(primals: list) -> bool:
    """Whether the inputs have symbolic sizes or values: fakes and ints over weld's ShapeEnv
    (backends/weld_symbolic.py)."""
    return any(isinstance(p, (FakeTensor, torch.SymInt)) for p in primals)


def _compiled_over_symbols(gm, state, input_positions, joint: JointGraph, part: Partition, primals: list,
                           options: dict, grad_strides, exact, forward_in_cuda_graph,
                           backward_in_cuda_graph, key: str | None) -> CompiledTrainingGraph:
    """A training graph of symbolic sizes: forward and backward compiled here, in this thread,
    whose ShapeEnv (compiler/symbols.py's compiling_over) records what both assume, before the
    caller makes the guard of calls that may run them; a graph weld cannot compile fails the
    compile over symbols (it goes per size), rather than running its aten ops. Kept as the
    training entry `key` (training_cache.py). Under CUDA graphs, each size is a recording of its
    own (runtime/cudagraphs.py)."""
    forward = compile_aten(part.forward, primals, options, "forward", symbolic=True)
    assumed = [n.meta.get("val") for n in part.backward.graph.nodes if n.op == "placeholder"]
    backward = compile_aten(part.backward, assumed, options, "backward", grad_strides(joint.grad_primals),
                            symbolic=True)
    keys = getattr(forward, "cache_key", None), getattr(backward, "cache_key", None)
    if forward_in_cuda_graph:
        forward = forward_in_cuda_graph(forward, joint.num_outputs)
        backward = backward_in_cuda_graph(backward, part.saved)
    write_back = WriteBack([primals[i].dtype for i in joint.mutated_primals])
    graph = TrainingGraph(forward, lambda example: backward, joint.num_outputs, joint.out_spec, joint.diff_outputs,
                          joint.mutated_primals, joint.grad_primals, part.saved, write_back,
                          forward_lends=bool(forward_in_cuda_graph), input_view_outputs=joint.input_view_outputs,
                          written_primal_views=joint.written_primal_views,
                          primal_outputs=joint.primal_outputs, primal_views=joint.primal_views,
                          enables_grad=not torch.is_grad_enabled(), numbers=part.numbers)
    if key is not None and None not in keys:
        training_cache.store(key, *keys, None, graph)
    return CompiledTrainingGraph(gm, state, input_positions, joint, part, graph, exact)


def _grad_and_autocast_as_now() -> Callable[[], contextlib.AbstractContextManager]:
    """A context manager factory that sets grad mode and autocast as they are now."""
    grad = torch.is_grad_enabled()
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]

    @contextlib.contextmanager
    def as_then():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for device, enabled, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype, enabled=enabled))
            yield

    return as_then


def _cached_training_graph(entry: dict, primals: list, options: dict, trace_and_partition, grad_strides,
                           forward_in_cuda_graph, backward_in_cuda_graph) -> TrainingGraph | None:
    """The TrainingGraph of a training entry (training_cache.py), None where its forward cannot
    be loaded: its backward loaded at the first backward, where its inputs have the layouts the
    entry's was compiled for; else traced and partitioned again, and compiled for them."""
    forward = graph_cache.load_unbound(entry["forward"])
    if forward is None:
        return None
    if forward_in_cuda_graph is not None:
        forward = forward_in_cuda_graph(forward, entry["num_outputs"])

    def compile_backward(example):
        with timing.phase("weld.backward_graph"), gc_pause.paused():
            backward = None
            if training_cache.layouts(example) == entry["backward_layouts"]:
                backward = graph_cache.load_unbound(entry["backward"])
            if backward is None:
                _, part = trace_and_partition()
                backward = compile_aten(part.backward, example, options, "backward", grad_strides(entry["grad_primals"]))
        return backward if backward_in_cuda_graph is None else backward_in_cuda_graph(backward, entry["saved"])

    return _entry_graph(entry, forward, compile_backward, primals, forward_lends=forward_in_cuda_graph is not None)


def _loaded_over_symbols(entry: dict, primals: list, forward_in_cuda_graph,
                         backward_in_cuda_graph) -> TrainingGraph | None:
    """The TrainingGraph of a training entry over symbols, both its graphs loaded now (their
    guards recorded in this compile's ShapeEnv, before the caller makes the guard of calls
    that may run them); None where either cannot be, or its guards do not hold at this call's
    sizes (traced again)."""
    forward = graph_cache.load_unbound(entry["forward"])
    backward = graph_cache.load_unbound(entry["backward"]) if forward is not None else None
    if backward is None:
        return None
    if forward_in_cuda_graph is not None:
        forward = forward_in_cuda_graph(forward, entry["num_outputs"])
        backward = backward_in_cuda_graph(backward, entry["saved"])
    return _entry_graph(entry, forward, lambda example: backward, primals,
                        forward_lends=forward_in_cuda_graph is not None)


def _entry_graph(entry: dict, forward, compile_backward, primals: list, forward_lends: bool) -> TrainingGraph:
    """A TrainingGraph from what a training entry holds of the trace and the partition."""
    write_back = WriteBack([primals[i].dtype for i in entry["mutated_primals"]])
    return TrainingGraph(forward, compile_backward, entry["num_outputs"], entry["out_spec"], entry["diff_outputs"],
                         entry["mutated_primals"], entry["grad_primals"], entry["saved"], write_back,
                         forward_lends=forward_lends, input_view_outputs=entry["input_view_outputs"],
                         written_primal_views=entry["written_primal_views"], primal_outputs=entry["primal_outputs"],
                         primal_views=entry["primal_views"], enables_grad=entry["enables_grad"],
                         numbers=entry["numbers"])


def compile_aten(gm: torch.fx.GraphModule, example_inputs: list, options: dict, what: str,
                 output_strides: list | None = None, handed_over=None, symbolic: bool = False):
    """weld's inference pipeline on one aten graph; the graph itself (aten ops, eagerly) if it
    cannot, or over symbols (`symbolic`) an error. `handed_over`: compile_graph's. The backward
    frees each input (saved activation, tangent) after its last reader (compile_graph's
    frees_inputs; runtime.py hands it its inputs through `call_boxed`)."""
    from torchweld.compiler import compile_graph
    from torchweld.compiler.lowering import LoweringError
    from torchweld.runtime.cpp_loader import CppCompileError

    # the aten graph run as it is: with autocast off, as the compiled one runs (the trace wrote
    # autocast's casts; runtime/autocast_off.py)
    as_traced = functools.partial(run_without_autocast, gm)
    if options.get("training_codegen", True) is False:
        if symbolic:  # (its aten graph spells symbolic sizes the wrapper would bind)
            raise NotImplementedError("training_codegen=False over symbols")
        return as_traced
    try:
        with torch.no_grad():
            return compile_graph(gm, list(example_inputs), options, traced=True, output_strides=output_strides,
                                 handed_over=handed_over, frees_inputs=what == "backward")
    except (LoweringError, CppCompileError) as e:
        if symbolic:
            raise
        log.warning("weld cannot compile the %s graph of this training step, running its aten ops eagerly: %s",
                    what, e)
        return as_traced


_ahead_pool: ThreadPoolExecutor | None = None


def _compile_ahead(compile_fn, assumed: list, options: dict) -> Future | None:
    """`compile_fn()` started in a background thread, where every assumed input layout is
    known (and options allow it: `backward_ahead`); None otherwise."""
    global _ahead_pool
    if not options.get("backward_ahead", True) or not all(isinstance(t, torch.Tensor) for t in assumed):
        return None
    if _ahead_pool is None:
        _ahead_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torchweld-backward")
    return _ahead_pool.submit(_paused, compile_fn)


def _paused(fn):
    """`fn()` with the garbage collector held off, also once capture, which started it, is done."""
    with gc_pause.paused():
        return fn()


def _result_if_layouts_match(ahead: Future | None, assumed: list, example: list):
    """The backward compiled ahead, if its inputs have the layouts it was compiled for (the
    saved tensors as the forward made them, the tangents made dense); None to compile again.
    An input on another device than the trace said passes where only extern calls read it:
    CUDA's efficient attention keeps its dropout's Philox seed and offset in CPU tensors,
    which its fake kernel puts on the GPU."""
    if ahead is None:
        return None
    moved = []
    for i, (a, t) in enumerate(zip(assumed, example)):
        if (a.shape, a.stride(), a.dtype) != (t.shape, t.stride(), t.dtype):
            return _mismatch(i, a, t)
        if a.device != t.device:
            moved.append(i)
    try:
        backward = ahead.result()
    except Exception as e:  # noqa: BLE001 - compiled again here, where the error is raised to the user
        log.debug("compiling the backward ahead failed (%s: %s); compiling it again", type(e).__name__, e)
        return None
    # a graph weld could not compile runs its aten ops eagerly: no kernel of its own reads anything
    read_by_kernels = getattr(backward, "inputs_read_by_kernels", lambda: set())()
    for i in moved:
        if i in read_by_kernels:
            return _mismatch(i, assumed[i], example[i])
    return backward


def _mismatch(i: int, assumed: torch.Tensor, got: torch.Tensor) -> None:
    log.debug("backward compiled ahead for input %d of layout %s%s %s %s, got %s%s %s %s: compiling it again",
              i, tuple(assumed.shape), assumed.stride(), assumed.dtype, assumed.device,
              tuple(got.shape), got.stride(), got.dtype, got.device)
    timing.record("weld.backward_graph.layout_mismatch", 0.0)
    return None


def _bind_constants(gm: torch.fx.GraphModule, example_inputs: list, kept: list[int]) -> torch.fx.GraphModule:
    """`gm` taking only its inputs at positions `kept`, with the others fixed to their example values."""
    graph = torch.fx.Graph()
    env = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = set(kept)
    for i, (n, x) in enumerate(zip(placeholders, example_inputs)):
        env[n] = graph.placeholder(n.name) if i in kept else x
        if i in kept:
            env[n].meta = dict(n.meta)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
    return graph_module(gm, graph)
