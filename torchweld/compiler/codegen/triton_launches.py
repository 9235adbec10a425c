"""The wrapper lines that launch one graph's Triton kernels.

Two sets of lines come out. The JIT lines (`k[(grid,)](a, b, XBLOCK=..)`) work
everywhere, Triton's CPU interpreter included. Where Triton allows it
(runtime/triton_launch.py), every kernel is also compiled ahead of time, all of
them at once in a thread pool, and launched through its compiled launcher: the
fast lines. Each pointer's 16-byte alignment is part of a compiled kernel; it is
known here for buffers the wrapper allocates, constants and fresh extern
results, and checked once per call for the graph's inputs: the wrapper runs
the JIT lines when one is misaligned. The fast lines pass each pointer as an
int (`buf.data_ptr()`), then the kernel's integer arguments (a size-generic kernel's
element count): handed a tensor, Triton's launcher calls its
`data_ptr()` and then asks the CUDA driver whether the address is a device
pointer (`cuPointerGetAttribute`), microseconds per argument, which made
densenet121's many-input concatenation kernels cost more CPU time to launch
than they ran. The wrapper's layouts and the guards' device checks already
say that every argument is a CUDA tensor of that device.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from torchweld.compiler import ir
from torchweld.compiler.codegen.triton import (int_classes, kernel_params, kernel_values, launch_candidates,
                                               launch_config, runtime_ints, tune_launch, unspecialized_params)
from torchweld.compiler.schedule import Kernel, Schedule
from torchweld.compiler.symbols import SizeText, is_symbol_size, size_text
from torchweld.runtime import triton_launch
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")


@dataclasses.dataclass
class TritonLaunches:
    jit: dict[str, str]  # kernel name -> launch through the JIT function
    fast: dict[str, str]  # kernel name -> launch through the compiled launcher (empty when unavailable)
    checked_inputs: list[str]  # graph inputs whose alignment the fast lines assume
    objects: dict[str, object]  # what the lines refer to by name
    stream_index: int | None  # the CUDA device whose current stream the fast lines launch on
    parts: dict[str, "FastLaunch"] = dataclasses.field(default_factory=dict)  # kernel name -> its fast line's parts


@dataclasses.dataclass(frozen=True)
class FastLaunch:
    """What a kernel's fast line is made from (`fast_launch`), which the graph cache keeps to
    make it again in another process: the compile job, the grid, the buffers, the integers."""

    job: triton_launch.CompileJob
    grid: int
    args: tuple[str, ...]
    ints: tuple[int, ...]


@dataclasses.dataclass
class _Kernel:
    """One kernel of the graph as TritonCompile holds it."""

    kernel: Kernel
    fn: object  # its runtime/triton_loader.GeneratedKernel (name, module file; the JIT function when used)
    args: list[str]  # computed once: Kernel.args builds a new list
    config: dict  # XBLOCK, RBLOCK, num_warps...
    job: object = None  # its CompileJob, once built (for the final config)


class TritonCompile:
    """One graph's Triton kernels, added as they are rendered and loaded, and their launch lines.

    `add` hands each kernel to the compilers at once where Triton allows compiling ahead of
    time (and no autotuning must time its candidates first), so kernels compile while later
    ones are still rendered; `finish` waits for them and writes the lines.

        compile = TritonCompile(kernels, sched, options)
        for kernel, fn in ...:                     # in the order kernels are rendered
            compile.add(kernel, fn)                # fn: its GeneratedKernel
        launches = compile.finish()
    """

    def __init__(self, kernels: list[Kernel], sched: Schedule, options: dict):
        self.sched, self.options = sched, options
        self.count = len(kernels)  # how many will come: worker processes pay off for a batch (submit_kernels)
        self.fast = bool(kernels) and all(triton_launch.fast_launch_available(k.device) for k in kernels)
        self.entries: list[_Kernel] = []

    def add(self, kernel: Kernel, fn) -> None:
        entry = _Kernel(kernel, fn, kernel.args, launch_config(kernel))
        self.entries.append(entry)
        if self.fast and not self.options.get("max_autotune"):
            try:
                triton_launch.submit_kernels([self._job(entry)], batch=self.count)
            except Exception as e:  # noqa: BLE001 - finish() submits it again, and reports what fails
                log.debug("cannot start compiling Triton kernel %s early: %s", kernel.name, e)

    def _job(self, entry: _Kernel):
        if entry.job is None:
            sched = self.sched
            entry.job = triton_launch.CompileJob(
                entry.fn.src, entry.fn, tuple(sched.layouts[a][0] for a in entry.args),
                tuple(_aligned(a, sched) for a in entry.args), tuple(sorted(entry.config.items())),
                entry.kernel.device, int_classes(entry.kernel),
                kernel_params(entry.kernel), unspecialized_params(entry.kernel))
        return entry.job

    def finish(self) -> TritonLaunches:
        entries, sched = self.entries, self.sched
        launches = TritonLaunches({}, {}, [], {}, None)
        if self.options.get("max_autotune"):  # runtime/autotune.py
            if self.fast:  # compile every candidate of every kernel at once before timing them one by one
                _precompile_candidates(entries, sched)
            for e in entries:
                e.config = tune_launch(e.kernel, e.fn, e.fn.name, e.args, sched.layouts, e.fn.path, self.options)

        grids = {e.kernel.name: _grid(e.kernel, e.config["XBLOCK"]) for e in entries}
        ints = {e.kernel.name: runtime_ints(e.kernel) for e in entries}
        for e in entries:
            name = e.kernel.name
            launches.objects[f"_k_{name}"] = e.fn
            arguments = [*e.args, *map(size_text, ints[name])]
            launches.jit[name] = (f"_k_{name}[({size_text(grids[name])},)]({', '.join(arguments)}, "
                                  + ", ".join(f"{key}={value}" for key, value in e.config.items()) + ")")
        if not self.fast:
            return launches

        try:
            handles = triton_launch.compile_kernels([self._job(e) for e in entries])
        except Exception as e:  # noqa: BLE001 - the JIT lines still run, and raise there if the kernel is wrong
            log.warning("compiling Triton kernels ahead of time failed, launching through Triton's JIT: %s", e)
            return launches
        inputs = set(n for n in sched.graph.input_names if n is not None)
        for e, handle in zip(entries, handles):
            name = e.kernel.name
            launches.fast[name] = fast_launch(name, grids[name], e.args, ints[name], handle, launches.objects)
            launches.parts[name] = FastLaunch(e.job, grids[name], tuple(e.args), tuple(ints[name]))
            launches.checked_inputs += [a for a in e.args if a in inputs and a not in launches.checked_inputs
                                        and _aligned(a, sched)]
        device = entries[0].kernel.device
        launches.stream_index = device.index if device.index is not None else torch.cuda.current_device()
        return launches


def _grid(kernel: Kernel, xblock: int) -> int | SizeText:
    """The blocks of a launch: its outputs over XBLOCK, rounded up (over symbols, as the
    wrapper's Python)."""
    outputs = math.prod(kernel.outer)
    if is_symbol_size(outputs):
        return SizeText(f"-(-max({size_text(outputs)}, 1) // {xblock})")
    return -(-max(outputs, 1) // xblock)


def fast_launch(name: str, grid: int, args: list[str], ints: tuple[int, ...], handle, objects: dict) -> str:
    """The wrapper line launching kernel `name` through its compiled launcher `handle` (a
    triton_launch.LaunchHandle) over `grid` blocks, with the buffers named in `args` and the
    integer arguments `ints`; what the line refers to by name goes into `objects`."""
    objects |= {f"_run_{name}": handle.launch, f"_fn_{name}": handle.function}
    lead = []
    for i, value in enumerate(handle.leading):
        if value is None or isinstance(value, (bool, int)):
            lead.append(repr(value))
        else:
            objects[f"_lead{i}_{name}"] = value
            lead.append(f"_lead{i}_{name}")
    arguments = lead + [f"{a}.data_ptr()" for a in args] + [size_text(v) for v in handle.passed(ints)]
    arguments += [str(v) for v in handle.trailing]
    return f"_run_{name}({size_text(grid)}, 1, 1, _stream, _fn_{name}, {', '.join(arguments)})"


def compile_order(kernels: list[Kernel]) -> list[Kernel]:
    """`kernels` in the order to render and hand them to the compilers: the largest first. A
    graph's first call waits for its slowest compile, and each compile starts once its kernel is
    rendered, so the kernels Triton takes longest over start first (the longest-first rule of
    scheduling jobs on parallel machines). Size is the number of distinct expression nodes a
    kernel computes, a Philox draw counted as the rounds it unrolls to; ties keep the schedule's
    order. The wrapper launches kernels in the schedule's order whatever this one is."""
    def nodes(kernel: Kernel) -> int:
        return sum(tuning.rand_nodes if node.op is ir.Op.RAND else 1
                   for value in kernel_values(kernel) for node in ir.walk(value)) + 10 * len(kernel.stages)

    return sorted(kernels, key=nodes, reverse=True)


def _aligned(name: str, sched: Schedule) -> bool:
    """Whether buffer `name`'s data pointer is 16-byte aligned on every call, or is
    a graph input or stored over one (whose alignment the wrapper checks)."""
    graph = sched.graph
    if name in graph.input_names and not sched.layouts[name][1].shape:
        # a 0-d input is read as one element, its alignment no help: not assumed, nor
        # checked. The backward's dropout seeds are views 8 bytes apart in one buffer of
        # seeds (runtime/seeded_rand.py); checked, every other one sent the call to the JIT.
        return False
    if name in sched.allocated or name in graph.input_names or name in sched.in_place:
        return True
    if name in graph.constants:
        return triton_launch.is_aligned(graph.constants[name])
    buf, index = ir.producer_of(name, graph.buffers)
    if not isinstance(buf, ir.Extern) or index >= len(buf.outputs):
        return False
    if getattr(buf.target, "_schema", None) is None or ir.returns_alias(buf.target):
        return False  # a view may start anywhere in its base
    dtype, layout = buf.outputs[index]
    return layout.offset * dtype.itemsize % triton_launch.ALIGNMENT == 0


def _precompile_candidates(entries: list[_Kernel], sched: Schedule) -> None:
    """Compile every autotuning candidate at once, for the synthetic arguments tune_launch times them on."""
    from torchweld.runtime.autotune import synthetic_tensor

    jobs = []
    for e in entries:
        args = [synthetic_tensor(*sched.layouts[a]) for a in e.args]
        aligned = tuple(triton_launch.is_aligned(t) for t in args)
        dtypes = tuple(t.dtype for t in args)
        ints = int_classes(e.kernel)
        for config in launch_candidates(e.kernel):
            jobs.append(triton_launch.CompileJob(e.fn.src, e.fn, dtypes, aligned, tuple(sorted(config.items())),
                                                 e.kernel.device, ints, kernel_params(e.kernel),
                                                 unspecialized_params(e.kernel)))
    for job, future in zip(jobs, triton_launch.submit_kernels(jobs)):
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile loses when it is timed
            log.debug("candidate %s of %s does not compile: %s", dict(job.config), job.fn, e)
