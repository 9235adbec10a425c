"""Compile one torch-level FX graph to a Python callable: aten graph, lowering,
schedule, kernel sources, wrapper — the pipeline, in order."""
from __future__ import annotations

import builtins
import dataclasses
import dis
import inspect
import linecache
import logging
import math
import weakref
from typing import Callable

import torch
import torch.utils._pytree as pytree

from torchweld import timing
from torchweld.compiler import graph_cache, ir
from torchweld.compiler.aten_graph import to_aten_graph, traced_aten_graph
from torchweld.compiler.codegen import size_args
from torchweld.compiler.codegen.cpp import CppRenderer
from torchweld.compiler.codegen.wrapper import PRELUDE, WrapperRenderer, fill_launches, launch_token
from torchweld.compiler.constant_folding import HoistedConstants, hoist_constants
from torchweld.compiler.lowering import GraphLowering, LoweringError
from torchweld.compiler.schedule import Kernel, Schedule, schedule
from torchweld.compiler.symbols import size_text
from torchweld.disk_cache import compiled_code, content_hash, write_source
from torchweld.runtime.autocast_off import autocast_off, run_without_autocast
from torchweld.runtime.triton_launch import ensure_context_function
from torchweld.runtime.unflatten import unflattener

log = logging.getLogger("torchweld.weld")
output_code_log = logging.getLogger("torchweld.output_code")


@dataclasses.dataclass
class CompiledGraph:
    """The callable weld returns, with what it was made of (for tests and tools)."""

    fn: object
    out_spec: pytree.TreeSpec
    schedule: Schedule | None  # None for a graph loaded from the graph cache
    wrapper_source: str
    kernel_sources: dict[str, str]  # "cpp" / "triton" -> source
    paths: dict[str, str | list[str]]  # "cpp" -> its source file; "triton" -> one file per kernel function
    hoisted: HoistedConstants | None = None  # constant work done once (constant_folding.py)
    # the wrapper taking its inputs in a list it empties, where the schedule frees inputs
    fn_boxed: object = None
    # makes the same wrapper with a torch.profiler range around the graph and each generated
    # kernel, called instead while a profiler records (one check a call when none does); made
    # at the first call under a profiler, not at every compile
    make_profiled: Callable[[], Callable] | None = None
    name: str = "graph"
    # what callers ask of the graph, kept here for a graph loaded from the graph cache, which has
    # no schedule: the inputs' buffer names (None: not a tensor), the inputs and constants the
    # graph writes in place (in the graph's order), the written constants themselves, the
    # positions of the inputs some generated kernel loads (the others reach extern calls
    # alone), one line per extern call
    input_names: list = dataclasses.field(default_factory=list)
    writes: list[str] = dataclasses.field(default_factory=list)
    written_constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    read_inputs: frozenset[int] = frozenset()
    externs: list[str] = dataclasses.field(default_factory=list)
    # the graph cache entry this graph was stored as or loaded from, where the entry binds no
    # module attribute (an aten graph of a training step): loadable by key alone
    # (graph_cache.load_unbound), what a training entry names (autograd/training_cache.py)
    cache_key: str | None = None
    _fn_profiled: Callable | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._outputs = unflattener(self.out_spec)  # the flat results -> what the graph returns

    def __call__(self, *args):
        return run_without_autocast(self._call, args)

    def _call(self, args: tuple):
        self.refresh_constants()
        if self.make_profiled is not None and torch.autograd._profiler_enabled():
            return self._profiled(list(args))
        return self._outputs(list(self.fn(*args)))

    def call_boxed(self, args: list):
        """The outputs for the inputs in `args`, which it empties: with the schedule's
        frees_inputs, an input nothing else holds goes back at its last reader."""
        return run_without_autocast(self._call_boxed, args)

    def _call_boxed(self, args: list):
        if self.make_profiled is not None and torch.autograd._profiler_enabled():
            self.refresh_constants()
            return self._profiled(args)
        if self.fn_boxed is None:
            outputs = self._call(tuple(args))
            args.clear()
            return outputs
        self.refresh_constants()
        return self._outputs(list(self.fn_boxed(args)))

    def _profiled(self, args: list):
        if self._fn_profiled is None:
            self._fn_profiled = self.make_profiled()
        with torch.profiler.record_function(f"torchweld {self.name}"):
            return self._outputs(list(self._fn_profiled(args)))

    def refresh_constants(self) -> None:
        """Recompute the hoisted constants if a parameter they come from changed (before a CUDA graph replay)."""
        if self.hoisted is not None:
            self.hoisted.refresh()

    def inputs_read_by_kernels(self) -> set[int]:
        """Positions of the inputs some generated kernel loads; the others reach extern calls alone."""
        return set(self.read_inputs)


def renderer_for(device: torch.device, options: dict):
    """CppRenderer for CPU tensors, TritonRenderer for CUDA ones (or when options ask for it);
    NotImplementedError for any other device (its node then calls aten: a meta tensor's
    data pointer in a C++ kernel crashed the process)."""
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"no kernels for tensors on {device}")
    if device.type == "cuda" or options.get("cpu_codegen") == "triton":
        from torchweld.compiler.codegen.triton import TritonRenderer

        return TritonRenderer
    return CppRenderer


def uses_triton(device: torch.device, options: dict) -> bool:
    """Whether `device`'s kernels are Triton's (False for a device that gets none)."""
    return device.type in ("cpu", "cuda") and renderer_for(device, options) is not CppRenderer


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                  traced: bool = False, output_strides: list | None = None,
                  handed_over: Callable[[], None] | None = None, frees_inputs: bool = False,
                  prepare: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None) -> CompiledGraph:
    """`traced`: `gm` is an aten graph traced already (compiled training's forward and backward).
    `prepare(gm)`: the torch-level passes (pipeline.FX_PASSES), run only where the graph cache
    has no entry: its key is the graph before them (the passes depend on nothing the key lacks).
    `output_strides`: for each output, None or the strides it must have (gradients in their
    parameter's layout, which autograd then keeps without a copy of its own). `handed_over()`
    is called once the graph's Triton kernels are all with the compilers, before they are
    waited for (a training step's backward starts compiling then). `frees_inputs`: the
    compiled graph frees each input after its last reader when called through
    `call_boxed` (schedule's frees_inputs; a training step's backward)."""
    options = dict(options or {})
    key = graph_cache.graph_key(gm, example_inputs, options, traced, output_strides, frees_inputs,
                                before_passes=prepare is not None)
    if key is not None:
        found = graph_cache.load(key, gm)
        if found is not None:
            if handed_over is not None:
                handed_over()
            return found
    if prepare is not None:
        gm = prepare(gm)
    with timing.phase("weld.aten_graph"):
        aten = traced_aten_graph(gm) if traced else to_aten_graph(gm, example_inputs)
        aten_gm, hoisted = hoist_constants(aten.gm) if options.get("freeze") else (aten.gm, None)
    triton = lambda device: uses_triton(device, options)  # noqa: E731
    lowering = GraphLowering(aten_gm, check=lambda buf: _check(buf, options), bias_in_kernel=triton,
                             split_reductions=lambda device: triton(device) and options.get("split_reductions", True),
                             cuda_graphs=bool(options.get("cudagraphs")))
    with timing.phase("weld.lower"), autocast_off():  # the trace wrote autocast's casts
        lowered = lowering.run(list(example_inputs), output_strides)
    for line in lowered.externs:
        log.debug("extern call: %s", line)
    with timing.phase("weld.schedule"):
        sched = schedule(lowered, frees_inputs)
    compiled, parts = _codegen(sched, aten.out_spec, options, handed_over)
    compiled.hoisted = hoisted
    if key is not None and hoisted is None and graph_cache.store(key, parts, aten.out_spec):
        compiled.cache_key = key.key
    return compiled


def _check(buf, options: dict) -> None:
    """Raise NotImplementedError if the renderer for `buf`'s device cannot render its body."""
    if not isinstance(buf, (ir.Pointwise, ir.Reduction)):
        return  # extern calls and inputs need no renderer
    renderer = renderer_for(buf.device, options)
    if isinstance(buf, ir.Reduction):
        renderer.check_reduction(buf.reduce_op, buf.body.dtype)
    renderer.check(buf.body)
    if buf.dtype not in renderer.dtype_names or buf.dtype in renderer.unsupported_dtypes:
        raise NotImplementedError(f"{renderer.name} has no dtype {buf.dtype}")


def _triton_kernels(renderer, kernels: list[Kernel], sched: Schedule, buffer_dtypes: dict, options: dict,
                    handed_over: Callable[[], None] | None):
    """(TritonLaunches, the kernels' source, their module files): each kernel rendered, loaded and
    handed to the compilers as it comes, largest first (compile_order), so the first ones compile
    while the rest are rendered; then `handed_over()`, then the wait for them."""
    from torchweld.compiler.codegen.triton_launches import TritonCompile, compile_order
    from torchweld.runtime.triton_loader import GeneratedKernel

    compile_ = TritonCompile(kernels, sched, options)
    loaded: dict[str, GeneratedKernel] = {}  # function name -> its kernel (imported when first used)
    with timing.phase("weld.render"):
        literal_members = 0 if options.get("sizes_as_arguments") else None
        for kernel, fn_name, module_source in renderer.render_modules(compile_order(kernels), buffer_dtypes,
                                                                      literal_members):
            if module_source is not None:
                loaded[fn_name] = GeneratedKernel(module_source, fn_name)
            compile_.add(kernel, loaded[fn_name])
    if handed_over is not None:
        handed_over()
    with timing.phase("weld.triton_compile"):
        launches = compile_.finish()
        for k in loaded.values():  # the files the compiled graph names are there
            k.written.result()
    return launches, "\n".join(k.src for k in loaded.values()), [k.path for k in loaded.values()]


def _in_range(kernel: Kernel, line: str | None) -> str | None:
    """A kernel's launch inside a torch.profiler range named after it (a trace names weld's kernels)."""
    if not line:
        return line
    kind = "reduction" if kernel.is_reduction else "pointwise"
    return f"with _range('torchweld {kernel.name} ({kind}, {kernel.device.type})'): {line}"


@dataclasses.dataclass
class Assembly:
    """A compiled graph before its launch lines and objects are put into its wrapper: what
    `assemble` makes the CompiledGraph from, here after code generation, and in graph_cache.py
    from a cache entry (whose fast launch lines are made anew from `fast_parts`)."""

    template: str  # the wrapper's source, with launch tokens (wrapper.launch_token)
    # the template of the wrapper with profiler ranges, and the constants it refers to
    render_profiled: Callable[[], tuple[str, dict]]
    jit: dict[str, str]  # kernel name -> its line through Triton's JIT or its C++ function
    fast: dict[str, str]  # kernel name -> its line through its compiled launcher
    constants: dict[str, object]  # what the wrapper refers to by name (WrapperRenderer.constants)
    kernel_objects: dict[str, object]  # what the launch lines refer to by name
    stream_index: int | None  # the CUDA device whose stream the fast lines read, if any
    boxed: bool  # the entry is `call_boxed` (the schedule frees inputs)
    sources: dict[str, str]  # "cpp" / "triton" -> the kernels' source
    paths: dict[str, str | list[str]]
    input_names: list
    writes: list[str]
    written_constants: list[str]
    read_inputs: frozenset[int]
    externs: list[str]
    # for the graph cache: the C++ kernels' (names, (pointers, integers)), the Triton kernels'
    # module sources (by function name) and function names (by kernel), their fast lines' parts,
    # and the operator or function of each extern's callable in `objects`
    cpp_kernels: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    triton_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    triton_functions: dict[str, str] = dataclasses.field(default_factory=dict)
    fast_parts: dict = dataclasses.field(default_factory=dict)
    origins: dict[str, object] = dataclasses.field(default_factory=dict)
    # the wrapper binds symbolic sizes (backends/weld_symbolic.py): `assemble` checks it names nothing
    # it leaves undefined (a symbol spelled but not bound); never so for a cache entry
    over_symbols: bool = False


def _codegen(sched: Schedule, out_spec, options: dict, handed_over: Callable[[], None] | None
             ) -> tuple[CompiledGraph, Assembly]:
    buffer_dtypes = {name: dtype for name, (dtype, _, _) in sched.layouts.items()}
    by_renderer: dict[type, list[Kernel]] = {}
    for k in sched.kernels():
        if math.prod(k.outer) == 0:
            continue  # no elements: nothing to compute
        by_renderer.setdefault(renderer_for(k.device, options), []).append(k)

    launches: dict[str, str] = {}  # kernel name -> line of the wrapper
    fast_launches: dict[str, str] = {}  # the same through Triton's compiled launchers (triton_launches.py)
    checked_inputs: list[str] = []
    stream_index = None
    kernel_objects: dict[str, object] = {}
    sources: dict[str, str] = {}
    paths: dict[str, str] = {}
    cpp_kernels: dict[str, tuple[int, int]] = {}
    triton_modules: dict[str, str] = {}
    triton_functions: dict[str, str] = {}
    fast_parts: dict = {}
    for renderer_cls, kernels in by_renderer.items():
        renderer = renderer_cls()
        if renderer_cls is CppRenderer:
            from torchweld.runtime.cpp_loader import load_kernels

            with timing.phase("weld.render"):
                source = renderer.render_kernels(kernels, buffer_dtypes, bool(options.get("sizes_as_arguments")))
            ints = {k.name: size_args.chosen(k).values() if size_args.chosen(k) else () for k in kernels}
            cpp_kernels = {k.name: (len(k.args), len(ints[k.name])) for k in kernels}
            with timing.phase("weld.cpp_compile"):
                fns, path = load_kernels(source, [k.name for k in kernels], cpp_kernels)
            sources["cpp"], paths["cpp"] = source, path
            for k in kernels:
                kernel_objects[f"_k_{k.name}"] = fns[k.name]
                arguments = [f"{a}.data_ptr()" for a in k.args] + [size_text(n) for n in ints[k.name]]
                launches[k.name] = f"_k_{k.name}({', '.join(arguments)})"
        else:
            triton, sources["triton"], paths["triton"] = _triton_kernels(renderer, kernels, sched, buffer_dtypes,
                                                                         options, handed_over)
            launches |= triton.jit
            fast_launches |= triton.fast
            checked_inputs, stream_index = triton.checked_inputs, triton.stream_index
            kernel_objects |= triton.objects
            fast_parts = triton.parts
            for k in kernels:
                fn = triton.objects[f"_k_{k.name}"]
                triton_functions[k.name] = fn.name
                triton_modules[fn.name] = fn.src

    if options.get("max_autotune"):  # aten mm/bmm against the Triton matmul template
        from torchweld.runtime.matmul_choice import choose_matmuls

        for line in choose_matmuls(sched, options, lambda device: uses_triton(device, options)):
            log.debug("matmul choice: %s", line)

    wrapper = WrapperRenderer(sched)
    jit = lambda k: launch_token("jit", k.name) if k.name in launches else None  # noqa: E731
    launch = (lambda k: launch_token("fast", k.name) if k.name in launches else None) if fast_launches else jit
    template = PRELUDE
    entry = "call_boxed" if sched.frees_inputs else "call"
    if fast_launches:  # the JIT launches run when an input is misaligned for the compiled kernels
        template += wrapper.render("call_jit", jit) + "\n" + wrapper.render(
            entry, launch, check_alignment=checked_inputs, stream_index=stream_index, boxed=sched.frees_inputs)
    else:
        template += wrapper.render(entry, jit, boxed=sched.frees_inputs)
    if sched.frees_inputs:  # called with positional inputs (tools, tests), it frees nothing the caller holds
        template += "\ndef call(*inputs):\n    return call_boxed(list(inputs))\n"

    def render_profiled() -> tuple[str, dict]:
        source = wrapper.render("call_profiled", lambda k: _in_range(k, launch(k)), boxed=True,
                                check_alignment=checked_inputs if fast_launches else (),
                                stream_index=stream_index if fast_launches else None)
        return source, dict(wrapper.constants)

    graph = sched.graph
    read = {name for k in sched.kernels() for name in k.reads}
    writes = [w.target for w in graph.mutated_inputs]
    parts = Assembly(
        template, render_profiled, launches, fast_launches, dict(wrapper.constants), kernel_objects, stream_index,
        sched.frees_inputs, sources, paths, list(graph.input_names), writes,
        [n for n in dict.fromkeys(writes) if n not in graph.input_names and n in graph.constants],
        frozenset(i for i, name in enumerate(graph.input_names) if name in read), list(graph.externs),
        cpp_kernels, triton_modules, triton_functions, fast_parts, dict(wrapper.origins),
        over_symbols=wrapper.binds_symbols)
    compiled = assemble(parts, out_spec)
    compiled.schedule = sched
    return compiled, parts


def _undefined_globals(namespace: dict) -> set[str]:
    """The global names the functions of a wrapper's `namespace` read that neither it nor the
    builtins define."""
    missing: set[str] = set()
    codes = [v.__code__ for v in namespace.values() if inspect.isfunction(v) and v.__globals__ is namespace]
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval not in namespace \
                    and not hasattr(builtins, ins.argval):
                missing.add(ins.argval)
    return missing


def assemble(parts: Assembly, out_spec) -> CompiledGraph:
    """The CompiledGraph of `parts`: its wrapper's source written to the cache (tracebacks and
    `output_code` logs show it) and run, its functions bound to the kernels and constants."""
    wrapper_source = fill_launches(parts.template, parts.jit, parts.fast)
    name = f"w{content_hash(wrapper_source)}"
    wrapper_path = write_source("wrappers", f"{name}.py", wrapper_source)
    paths = {**parts.paths, "wrapper": wrapper_path}
    namespace = {"torch": torch, "math": math, **parts.constants, **parts.kernel_objects}  # (math: symbolic sizes)
    if parts.stream_index is not None:
        namespace["_raw_stream"] = torch._C._cuda_getCurrentRawStream
        namespace["_ensure_context"] = ensure_context_function()
    exec(compiled_code(wrapper_source, wrapper_path), namespace)

    in_linecache: list[str] = []

    def make_profiled():
        template, constants = parts.render_profiled()
        source = fill_launches(template, parts.jit, parts.fast)
        path = f"{wrapper_path[:-3]}_profiled (in memory)"  # tracebacks show its lines through linecache
        linecache.cache[path] = (len(source), None, source.splitlines(True), path)
        in_linecache.append(path)
        namespace.update(constants)
        exec(compile(source, path, "exec"), namespace)
        return namespace["call_profiled"]

    if output_code_log.isEnabledFor(logging.INFO):
        text = [f"wrapper: {wrapper_path}", wrapper_source]
        for kind, src in parts.sources.items():
            text += [f"{kind} kernels: {paths[kind]}", src]
        output_code_log.info("\n".join(text))
    namespace["_range"] = torch.profiler.record_function
    undefined = sorted(_undefined_globals(namespace)) if parts.over_symbols else ()
    if undefined:  # (a symbolic size the wrapper does not bind, spelled as a name)
        raise LoweringError(f"the wrapper {wrapper_path} reads names it does not define: {', '.join(undefined)}")
    compiled = CompiledGraph(namespace["call"], out_spec, None, wrapper_source, parts.sources, paths,
                             fn_boxed=namespace.get("call_boxed"), make_profiled=make_profiled,
                             name=f"graph {name[:9]}", input_names=parts.input_names, writes=parts.writes,
                             written_constants={n: namespace[n] for n in parts.written_constants},
                             read_inputs=parts.read_inputs, externs=parts.externs)
    # the wrapper's functions and their globals (kernels, the parameters as constants) are a cycle:
    # emptied once the graph is dropped, they go at once, not at the next cyclic collection
    weakref.finalize(compiled, _forget, namespace, in_linecache)
    return compiled


def _forget(namespace: dict, paths: list[str]) -> None:
    namespace.clear()
    for path in paths:
        linecache.cache.pop(path, None)
