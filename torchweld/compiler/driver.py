"""Compile one torch-level FX graph to a Python callable: aten graph, lowering,
schedule, kernel sources, wrapper — the pipeline, in order."""
from __future__ import annotations

import dataclasses
import linecache
import logging
import math
import weakref
from typing import Callable

import torch
import torch.utils._pytree as pytree

from torchweld import timing
from torchweld.compiler import ir
from torchweld.compiler.aten_graph import to_aten_graph, traced_aten_graph
from torchweld.compiler.codegen import size_args
from torchweld.compiler.codegen.cpp import CppRenderer
from torchweld.compiler.codegen.wrapper import PRELUDE, WrapperRenderer
from torchweld.compiler.constant_folding import HoistedConstants, hoist_constants
from torchweld.compiler.lowering import GraphLowering
from torchweld.compiler.schedule import Kernel, Schedule, schedule
from torchweld.disk_cache import content_hash, write_source
from torchweld.runtime.autocast_off import autocast_off, run_without_autocast
from torchweld.runtime.triton_launch import ensure_context_function

log = logging.getLogger("torchweld.weld")
output_code_log = logging.getLogger("torchweld.output_code")


@dataclasses.dataclass
class CompiledGraph:
    """The callable weld returns, with what it was made of (for tests and tools)."""

    fn: object
    out_spec: pytree.TreeSpec
    schedule: Schedule
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
    _fn_profiled: Callable | None = dataclasses.field(default=None, repr=False)

    def __call__(self, *args):
        return run_without_autocast(self._call, args)

    def _call(self, args: tuple):
        self.refresh_constants()
        if self.make_profiled is not None and torch.autograd._profiler_enabled():
            return self._profiled(list(args))
        return pytree.tree_unflatten(list(self.fn(*args)), self.out_spec)

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
        return pytree.tree_unflatten(list(self.fn_boxed(args)), self.out_spec)

    def _profiled(self, args: list):
        if self._fn_profiled is None:
            self._fn_profiled = self.make_profiled()
        with torch.profiler.record_function(f"torchweld {self.name}"):
            return pytree.tree_unflatten(list(self._fn_profiled(args)), self.out_spec)

    def refresh_constants(self) -> None:
        """Recompute the hoisted constants if a parameter they come from changed (before a CUDA graph replay)."""
        if self.hoisted is not None:
            self.hoisted.refresh()

    @property
    def externs(self) -> list[str]:
        return self.schedule.graph.externs

    def inputs_read_by_kernels(self) -> set[int]:
        """Positions of the inputs some generated kernel loads; the others reach extern calls alone."""
        read = {name for k in self.schedule.kernels() for name in k.reads}
        return {i for i, name in enumerate(self.schedule.graph.input_names) if name in read}


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
                  handed_over: Callable[[], None] | None = None, frees_inputs: bool = False) -> CompiledGraph:
    """`traced`: `gm` is an aten graph traced already (compiled training's forward and backward).
    `output_strides`: for each output, None or the strides it must have (gradients in their
    parameter's layout, which autograd then keeps without a copy of its own). `handed_over()`
    is called once the graph's Triton kernels are all with the compilers, before they are
    waited for (a training step's backward starts compiling then). `frees_inputs`: the
    compiled graph frees each input after its last reader when called through
    `call_boxed` (schedule's frees_inputs; a training step's backward)."""
    options = dict(options or {})
    with timing.phase("weld.aten_graph"):
        aten = traced_aten_graph(gm) if traced else to_aten_graph(gm, example_inputs)
        aten_gm, hoisted = hoist_constants(aten.gm) if options.get("freeze") else (aten.gm, None)
    triton = lambda device: uses_triton(device, options)  # noqa: E731
    lowering = GraphLowering(aten_gm, check=lambda buf: _check(buf, options), bias_in_kernel=triton,
                             split_reductions=lambda device: triton(device) and options.get("split_reductions", True))
    with timing.phase("weld.lower"), autocast_off():  # the trace wrote autocast's casts
        lowered = lowering.run(list(example_inputs), output_strides)
    for line in lowered.externs:
        log.debug("extern call: %s", line)
    with timing.phase("weld.schedule"):
        sched = schedule(lowered, frees_inputs)
    compiled = _codegen(sched, aten.out_spec, options, handed_over)
    compiled.hoisted = hoisted
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


def _codegen(sched: Schedule, out_spec, options: dict, handed_over: Callable[[], None] | None) -> CompiledGraph:
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
    for renderer_cls, kernels in by_renderer.items():
        renderer = renderer_cls()
        if renderer_cls is CppRenderer:
            from torchweld.runtime.cpp_loader import load_kernels

            with timing.phase("weld.render"):
                source = renderer.render_kernels(kernels, buffer_dtypes, bool(options.get("sizes_as_arguments")))
            ints = {k.name: size_args.chosen(k).values() if size_args.chosen(k) else () for k in kernels}
            with timing.phase("weld.cpp_compile"):
                fns, path = load_kernels(source, [k.name for k in kernels],
                                         {k.name: (len(k.args), len(ints[k.name])) for k in kernels})
            sources["cpp"], paths["cpp"] = source, path
            for k in kernels:
                kernel_objects[f"_k_{k.name}"] = fns[k.name]
                arguments = [f"{a}.data_ptr()" for a in k.args] + [str(n) for n in ints[k.name]]
                launches[k.name] = f"_k_{k.name}({', '.join(arguments)})"
        else:
            triton, sources["triton"], paths["triton"] = _triton_kernels(renderer, kernels, sched, buffer_dtypes,
                                                                         options, handed_over)
            launches |= triton.jit
            fast_launches |= triton.fast
            checked_inputs, stream_index = triton.checked_inputs, triton.stream_index
            kernel_objects |= triton.objects

    if options.get("max_autotune"):  # aten mm/bmm against the Triton matmul template
        from torchweld.runtime.matmul_choice import choose_matmuls

        for line in choose_matmuls(sched, options, lambda device: uses_triton(device, options)):
            log.debug("matmul choice: %s", line)

    wrapper = WrapperRenderer(sched)
    wrapper_source = PRELUDE
    entry = "call_boxed" if sched.frees_inputs else "call"
    if fast_launches:  # the JIT launches run when an input is misaligned for the compiled kernels
        wrapper_source += wrapper.render("call_jit", lambda k: launches.get(k.name)) + "\n" + wrapper.render(
            entry, lambda k: fast_launches.get(k.name) or launches.get(k.name),
            check_alignment=checked_inputs, stream_index=stream_index, boxed=sched.frees_inputs)
    else:
        wrapper_source += wrapper.render(entry, lambda k: launches.get(k.name), boxed=sched.frees_inputs)
    if sched.frees_inputs:  # called with positional inputs (tools, tests), it frees nothing the caller holds
        wrapper_source += "\ndef call(*inputs):\n    return call_boxed(list(inputs))\n"
    name = f"w{content_hash(wrapper_source)}"
    wrapper_path = write_source("wrappers", f"{name}.py", wrapper_source)
    paths["wrapper"] = wrapper_path
    namespace = {"torch": torch, **wrapper.constants, **kernel_objects}
    if stream_index is not None:
        namespace["_raw_stream"] = torch._C._cuda_getCurrentRawStream
        namespace["_ensure_context"] = ensure_context_function()
    exec(compile(wrapper_source, wrapper_path, "exec"), namespace)
    launch = (lambda k: fast_launches.get(k.name) or launches.get(k.name)) if fast_launches else \
        (lambda k: launches.get(k.name))

    in_linecache: list[str] = []

    def make_profiled():
        source = wrapper.render("call_profiled", lambda k: _in_range(k, launch(k)), boxed=True,
                                check_alignment=checked_inputs if fast_launches else (),
                                stream_index=stream_index if fast_launches else None)
        path = f"{wrapper_path[:-3]}_profiled (in memory)"  # tracebacks show its lines through linecache
        linecache.cache[path] = (len(source), None, source.splitlines(True), path)
        in_linecache.append(path)
        namespace.update(wrapper.constants)
        exec(compile(source, path, "exec"), namespace)
        return namespace["call_profiled"]

    if output_code_log.isEnabledFor(logging.INFO):
        text = [f"wrapper: {wrapper_path}", wrapper_source]
        for kind, src in sources.items():
            text += [f"{kind} kernels: {paths[kind]}", src]
        output_code_log.info("\n".join(text))
    namespace["_range"] = torch.profiler.record_function
    compiled = CompiledGraph(namespace["call"], out_spec, sched, wrapper_source, sources, paths,
                             fn_boxed=namespace.get("call_boxed"), make_profiled=make_profiled,
                             name=f"graph {name[:9]}")
    # the wrapper's functions and their globals (kernels, the parameters as constants) are a cycle:
    # emptied once the graph is dropped, they go at once, not at the next cyclic collection
    weakref.finalize(compiled, _forget, namespace, in_linecache)
    return compiled


def _forget(namespace: dict, paths: list[str]) -> None:
    namespace.clear()
    for path in paths:
        linecache.cache.pop(path, None)
