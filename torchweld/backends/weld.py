"""The `weld` backend: fused C++/OpenMP kernels for CPU tensors and Triton kernels
for CUDA tensors, with aten kernels (matmul, convolution, ...) called where no
lowering exists. A graph that needs autograd compiles for training (torchweld/autograd):
a joint forward+backward graph, partitioned, both halves through the same pipeline."""
from __future__ import annotations

import logging

import torch
import torch.utils._pytree as pytree

from torchweld import logs, timing
from torchweld.backends import BackendOptions, Option, register_backend
from torchweld.backends.module_settings import SettingsGuarded, leaf_settings
from torchweld.backends.weld_declines import UNTRACEABLE, Decline, why_declined
from torchweld.backends.weld_sizes import CompiledPerSize
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")


def _compile_training(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None, options: dict,
                      symbolic: bool = False):
    """The graph compiled for training; run eagerly where weld cannot, or over symbols
    (`symbolic`) an error: the caller compiles it per size."""
    from torchweld.autograd import TrainingUnsupported, compile_training

    try:
        return compile_training(gm, list(example_inputs), compile_options(mode, options),
                                cudagraphs=cudagraph_wrapper(mode, options, gm))
    except TrainingUnsupported as e:
        if symbolic:
            raise
        log.warning("weld cannot compile this graph for training, running it eagerly: %s", e)
        return gm.forward
    except UNTRACEABLE as e:
        if symbolic:
            raise
        log.warning("weld cannot trace this graph for training, running it eagerly: %s: %s", type(e).__name__, e)
        return gm.forward


def needs_autograd(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    return reads_grad_tensors(gm, example_inputs) and records_autograd(gm)


def reads_grad_tensors(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """Grad mode is on (or a `with torch.enable_grad()` block of `gm` turns it on) and an input,
    parameter or buffer of `gm` requires grad."""
    if not torch.is_grad_enabled() and not enables_grad(gm):
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    tensors += [v for v in gm.__dict__.values() if isinstance(v, torch.Tensor)]
    return any(t.requires_grad for t in tensors)


def enables_grad(gm: torch.fx.GraphModule) -> bool:
    """Whether `gm` turns grad mode on somewhere (a `with torch.enable_grad()` block)."""
    return any(node.target is torch._C._set_grad_enabled and node.args[0] for node in gm.graph.nodes)


def records_autograd(gm: torch.fx.GraphModule) -> bool:
    """Whether an operation of `gm` runs in grad mode and gives a tensor that requires
    grad, by the capture's example values (True where a node has none to tell). An
    optimizer step reads parameters that require grad, but under no_grad."""
    enabled = torch.is_grad_enabled()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.target is torch._C._set_grad_enabled:
            enabled = node.args[0]
        elif enabled:
            if "example_value" not in node.meta:
                return True
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(node.meta["example_value"])):
                return True
    return False


# Every key `options=` takes for weld; torchweld.compile refuses any other (backends.check_options).
OPTIONS = {
    "fuse_attention": Option("softmax(q @ k^T * scale) @ v becomes one scaled_dot_product_attention call "
                             "(passes/fuse_attention.py); default True"),
    "group_query_heads": Option("decoding attention over repeated key/value heads (grouped-query attention) "
                                "runs over the unrepeated heads (passes/grouped_attention.py); default True"),
    "gated_matvec": Option("under CUDA graphs, a one-row SwiGLU gate silu(linear(x, w_gate)) * linear(x, w_up) in "
                           "half precision is one kernel (passes/decode_products.py); default False (not yet "
                           "measured on a GPU)"),
    "grouped_matvec": Option("under CUDA graphs, one-row linear layers without bias that read one input (q/k/v "
                             "projections) in half precision are one kernel (passes/decode_products.py); "
                             "default False (not yet measured on a GPU)"),
    "empty_concatenations": Option("a concatenation of one tensor and empty 1-d tensors is that tensor, read in "
                                   "place where nothing can tell (compiler/cat_chains.py); default True"),
    "chain_concatenations": Option("a concatenation that extends an earlier one reads it instead of all its "
                                   "inputs again (compiler/cat_chains.py); default True"),
    "freeze": Option("inference: fold batch norms into convolutions and compute what depends only on "
                     "parameters once (compiler/constant_folding.py); default False"),
    "channels_last": Option("convolutions in channels-last (passes/channels_last.py); default True"),
    "cudagraphs": Option("record CUDA graphs (runtime/cudagraphs.py); default: on for mode='reduce-overhead' "
                         "and 'max-autotune'"),
    "max_autotune": Option("time candidate kernels and keep the fastest (runtime/autotune.py); default: on "
                           "for mode='max-autotune' and 'max-autotune-no-cudagraphs'"),
    "cudagraph_outputs": Option("what a CUDA-graph replay hands out: 'copy' (default) or 'track' (the "
                                "recording's own buffers)", choices=("copy", "track")),
    "cudagraph_pool": Option("a runtime.cudagraphs.CudaGraphPool to share between compiled models (default: "
                             "one per compiled model)", types=(object,)),
    "autotuner": Option("the runtime.autotune.Autotuner that times candidates (default: a new one)", types=(object,)),
    "autotune_timer": Option("the timer an Autotuner made here uses (tests)", types=(object,)),
    "size_specializations": Option("a graph with symbolic sizes: for how many sizes weld compiles it (later "
                                   "ones run as captured; backends/weld_sizes.py); default: "
                                   f"tuning.default_specializations, {tuning.default_specializations}", types=(int,)),
    "symbolic_kernels": Option("a graph with symbolic sizes: compile it once over its symbols where weld can "
                               "(backends/weld_symbolic.py), before compiling it per size; default True"),
    "sizes_as_arguments": Option("kernels take their integers as arguments, so kernels that differ only in sizes "
                                 "are one compiled function (Triton) or one library (C++); default: on for a graph "
                                 "with symbolic sizes (backends/weld_sizes.py), else Triton's from a kernel's third "
                                 "such sibling"),
    "split_reductions": Option("Triton: a long reduction runs in two kernels, split across blocks; default True"),
    "cpu_codegen": Option("the code CPU kernels are written in: 'cpp' (default) or 'triton' (through Triton's "
                          "interpreter, for tests)", choices=("cpp", "triton")),
    "training_codegen": Option("training: compile the forward and backward graphs with weld's kernels "
                               "(False: run the partitioned aten graphs); default True"),
    "backward_ahead": Option("training: compile the backward in a thread while the forward compiles; default True"),
    "partition": Option("training: what the forward saves for the backward: 'min_cut' (default) or 'save_all'",
                        choices=("min_cut", "save_all")),
}


@register_backend("weld")
def weld(gm: torch.fx.GraphModule, example_inputs: list, mode=None, options=None):
    # the BackendOptions of this compiled model (backends.lookup_backend): graphs share its `shared`
    options = {} if options is None else options
    declined = why_declined(gm, example_inputs)
    if declined is not None and declined[0] is Decline.SYMBOLIC_SIZES:  # over symbols, else per size
        limit = options.get("size_specializations", tuning.default_specializations)
        per_size = BackendOptions.derived(options, sizes_as_arguments=True)  # kernels shared across sizes
        sizes = CompiledPerSize(gm, lambda static_gm, inputs: weld(static_gm, inputs, mode, per_size), limit)
        return _symbolic(gm, example_inputs, mode, per_size, sizes)
    if declined is not None:
        kind, detail = declined
        log.warning("weld runs this graph without its kernels (%s): %s", detail, kind.value)
        return gm.forward
    settings = leaf_settings(gm)
    if not settings:
        return _weld(gm, example_inputs, mode, options)
    # the leaf modules' settings (bn.momentum) are numbers in weld's kernels: checked at each call
    return SettingsGuarded(lambda inputs: _weld(gm, inputs, mode, options), settings, gm.forward, example_inputs)


def _symbolic(gm: torch.fx.GraphModule, example_inputs: list, mode, options: dict, per_size: CompiledPerSize):
    """`gm` compiled once over symbolic sizes (weld_symbolic.py), `per_size` calling it where its
    compile's guards hold; `per_size` alone where it cannot be compiled so."""
    from torchweld.backends.weld_symbolic import CompiledSymbolic, SymbolicCopy
    from torchweld.compiler.symbols import compiling_over

    if not options.get("symbolic_kernels", True):
        return per_size
    try:
        with timing.phase("weld.symbolic_copy"):
            copy = SymbolicCopy(gm, tuple(example_inputs))
        with compiling_over(copy.env):
            compiled = _weld(copy.gm, copy.inputs, mode, options, symbolic=True)
        guard = copy.guard()
    except Exception as e:  # noqa: BLE001 - any graph weld cannot compile over symbols is compiled per size
        logs.get("dynamic").info("weld compiles this graph per size: it cannot compile it over symbols: %s: %s",
                                 type(e).__name__, e, exc_info=logs.get("dynamic").isEnabledFor(logging.DEBUG))
        return per_size
    # the leaf modules' settings (ln.eps) are numbers in its kernels: changed, a call goes per size,
    # whose compiles read them anew (module_settings.py)
    return CompiledSymbolic(compiled, guard, [copy.symbols[s] for s in guard.symbols], per_size, leaf_settings(gm))


def _weld(gm: torch.fx.GraphModule, example_inputs: list, mode, options: dict, symbolic: bool = False):
    grad_tensors = reads_grad_tensors(gm, example_inputs)
    training = grad_tensors and records_autograd(gm)
    if _on_cuda(gm, example_inputs):
        _start_cuda_helpers(workers=len(gm.graph.nodes) >= tuning.workers_from_nodes)
    if training:
        return _compile_training(prepare(gm, options, inference=False), example_inputs, mode, options, symbolic)
    from torchweld.backends.weld_symbolic import SymbolicCompileError
    from torchweld.compiler import compile_graph
    from torchweld.compiler.lowering import LoweringError
    from torchweld.runtime.cpp_loader import CppCompileError

    try:
        compiled = compile_graph(gm, list(example_inputs), compile_options(mode, options),
                                 prepare=lambda captured: prepare(captured, compile_options(mode, options),
                                                                  inference=True))
    except (LoweringError, CppCompileError) as e:
        if symbolic:
            raise SymbolicCompileError(str(e)) from e
        log.warning("weld cannot compile this graph, running it eagerly: %s", e)
        compiled = gm.forward
    except UNTRACEABLE as e:
        if symbolic:
            raise SymbolicCompileError(f"{type(e).__name__}: {e}") from e
        log.warning("weld cannot trace this graph, running it eagerly: %s: %s", type(e).__name__, e)
        compiled = gm.forward
    call = with_cudagraphs(compiled, gm, mode, options)
    call = _without_grad(call) if grad_tensors else call
    call = _detaching_views(call, gm, example_inputs)
    return _exact_where_written_inputs_overlap(call, compiled, gm)


def _exact_where_written_inputs_overlap(call, compiled, gm: torch.fx.GraphModule):
    """`call`, or for a graph whose kernels write tensors in place, `call` on the calls where no
    written tensor shares memory with another input and the captured graph on the others
    (runtime/input_overlap.py)."""
    from torchweld.compiler.driver import CompiledGraph
    from torchweld.runtime.input_overlap import OverlapChecked, WrittenOverlap

    if not isinstance(compiled, CompiledGraph) or not compiled.writes:
        return call
    targets = set(compiled.writes)
    names = compiled.input_names
    constants = list(compiled.written_constants.values())
    written = [i for i, name in enumerate(names) if name in targets]
    written += [len(names) + k for k in range(len(constants))]
    inputs = [i for i, name in enumerate(names) if name is not None]
    return OverlapChecked(call, gm.forward, WrittenOverlap(written, inputs), constants)


def _start_cuda_helpers(workers: bool) -> None:
    """Start in threads what the Triton kernels of a CUDA graph will wait for, each once per
    process: torchweld's launcher (a C build), Triton's driver (its C build), Triton's key of
    itself (a hash of its library), and with `workers` the compile worker processes. All
    overlap the capture, tracing and lowering."""
    from torchweld.runtime.triton_launch import fast_launch_available, kernel_launcher, triton_driver

    if not fast_launch_available(torch.device("cuda")):  # kernels compile and launch through Triton's JIT
        return
    from torchweld.runtime import triton_workers

    kernel_launcher.start_in_background()
    triton_driver.start_in_background()
    triton_workers.install_key.start_in_background()  # hashing releases the GIL: it overlaps the tracing
    if workers:
        triton_workers.start_in_background()


def warm_up(args: tuple, kwargs: dict) -> None:
    """Before a frame is captured for weld (backends.backend_warm_up): if the call's tensors,
    or the parameters of a module it is a method of, are on CUDA, start the CUDA helpers now."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    module = args[0] if args and isinstance(args[0], torch.nn.Module) else None
    if module is not None:
        tensors += [next(module.parameters(), None), next(module.buffers(), None)]
    if any(t is not None and t.is_cuda for t in tensors):
        _start_cuda_helpers(workers=tuning.workers_at_first_call)


weld.warm_up = warm_up
weld.known_options = OPTIONS


def _on_cuda(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return any(t.is_cuda for t in [*tensors, *gm.parameters(), *gm.buffers()])


def _without_grad(compiled):
    """`compiled` run under no_grad: a graph that reads tensors requiring grad reaches here
    only when nothing in it records autograd (an optimizer step, under no_grad in the
    graph), and its externs and in-place writes must not either."""
    def call(*args):
        with torch.no_grad():
            return compiled(*args)

    return call


def _detaching_views(compiled, gm: torch.fx.GraphModule, example_inputs: list):
    """`compiled`, with each output that eager gives as not requiring grad detached where
    compiled's requires it. The wrapper makes `loss.detach()` a view of `loss`, and a view of a
    tensor that requires grad requires grad too, even under no_grad; kernels' outputs never
    do. So only graphs with a detach need this, and only outputs whose example value (the
    capture's) does not require grad."""
    from torchweld.runtime.cudagraphs import call_name

    if not any(call_name(n) == "detach" for n in gm.graph.nodes):
        return compiled
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)] + list(gm.parameters())
    if not any(t.requires_grad for t in tensors):
        return compiled
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = pytree.tree_leaves(output.args[0])
    detached = frozenset(i for i, node in enumerate(flat) if isinstance(node, torch.fx.Node)
                         and isinstance(node.meta.get("example_value"), torch.Tensor)
                         and not node.meta["example_value"].requires_grad)
    if not detached:
        return compiled

    def call(*args):
        out = compiled(*args)
        if isinstance(out, (tuple, list)) and len(out) == len(flat):
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in out):
                out = type(out)(t.detach() if i in detached and isinstance(t, torch.Tensor) else t
                                for i, t in enumerate(out))
        elif isinstance(out, torch.Tensor) and out.requires_grad and detached == {0} and len(flat) == 1:
            out = out.detach()
        return out

    return call


def prepare(gm: torch.fx.GraphModule, options: dict, inference: bool) -> torch.fx.GraphModule:
    """The torch-level passes before lowering (compiler/pipeline.py's FX_PASSES, in order)."""
    from torchweld.compiler.pipeline import run_fx_passes

    return run_fx_passes(gm, options, inference)


# -- modes: which of CUDA graphs and autotuning a compile asked for ---------------
# mode=None/"default": neither; "reduce-overhead": CUDA graphs; "max-autotune":
# both; "max-autotune-no-cudagraphs": autotuning. options={"cudagraphs": bool} and
# options={"max_autotune": bool} turn either on or off whatever the mode.
CUDAGRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
AUTOTUNE_MODES = frozenset({"max-autotune", "max-autotune-no-cudagraphs"})


def cudagraphs_enabled(mode: str | None, options: dict | None) -> bool:
    options = options or {}
    return bool(options.get("cudagraphs", mode in CUDAGRAPH_MODES))


def autotune_enabled(mode: str | None, options: dict | None) -> bool:
    options = options or {}
    return bool(options.get("max_autotune", mode in AUTOTUNE_MODES))


def compile_options(mode: str | None, options: dict | None) -> dict:
    """The options compile_graph sees: the user's, with "max_autotune" and "cudagraphs" settled
    from the mode."""
    return {**(options or {}), "max_autotune": autotune_enabled(mode, options),
            "cudagraphs": cudagraphs_enabled(mode, options)}


def cudagraph_wrapper(mode: str | None, options: dict | None, gm: torch.fx.GraphModule | None = None):
    """For compiled training (torchweld/autograd): None when mode/options ask for no
    CUDA graphs, else `wrap(fn, name, static_input_indices=(), mutated_input_indices=(),
    outputs="copy", lent_from=None)` recording `fn` into this model's pool; with `gm`, the captured graph,
    nothing is recorded when it holds what cannot be (CPU tensors, synchronizing ops).
    Call it on the options the backend received (not a copy: its `shared` holds the model's
    pool), e.g. for a forward over (params..., inputs...):

        wrap = cudagraph_wrapper(mode, options, gm)
        if wrap:
            forward = wrap(forward, "forward", static_input_indices=range(n_params), outputs="track")
            backward = wrap(backward, "backward")
    """
    if not cudagraphs_enabled(mode, options) or options is None:
        return None
    from torchweld.runtime.cudagraphs import CudaGraphed, graph_reason, pool_for

    pool = pool_for(options)
    reason = graph_reason(gm, pool.recorder.device_type) if gm is not None else None

    def wrap(fn, name: str, static_input_indices=(), mutated_input_indices=(), outputs: str | None = None,
             lent_from: int | None = None):
        return CudaGraphed(fn, pool=pool, name=pool.next_name(f"weld {name}"),
                           static_input_indices=tuple(static_input_indices),
                           mutated_input_indices=tuple(mutated_input_indices),
                           outputs=outputs or options.get("cudagraph_outputs", "copy"), graph_reason=reason,
                           lent_from=lent_from)

    return wrap


def with_cudagraphs(compiled, gm: torch.fx.GraphModule, mode: str | None, options: dict | None):
    """`compiled` recorded as CUDA graphs when the mode or options ask for it (runtime/cudagraphs.py).

    The pool lives in `options.shared` (backends.BackendOptions: one per compiled model, handed
    to every backend call of that model), so all graphs of that model share it. The graph's inputs
    are the captured frame's, whose guards check each tensor's layout (`guarded`)."""
    if not cudagraphs_enabled(mode, options) or options is None:
        return compiled
    from torchweld.compiler.driver import CompiledGraph
    from torchweld.runtime.cudagraphs import (
        CudaGraphed, graph_reason, mutated_placeholders, pool_for, resident_placeholders,
    )

    pool = pool_for(options)
    mutated = set(mutated_placeholders(gm))
    if isinstance(compiled, CompiledGraph):
        mutated |= {compiled.input_names.index(t) for t in compiled.writes if t in compiled.input_names}
    return CudaGraphed(compiled, pool=pool, name=pool.next_name("weld graph"),
                       static_input_indices=resident_placeholders(gm), mutated_input_indices=sorted(mutated),
                       outputs=options.get("cudagraph_outputs", "copy"),
                       graph_reason=graph_reason(gm, pool.recorder.device_type),
                       before_replay=getattr(compiled, "refresh_constants", None), guarded=True)
