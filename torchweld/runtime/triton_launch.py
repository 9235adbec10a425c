"""Compile weld's Triton kernels ahead of time, several at once, and launch them
without Triton's per-call argument binding.

`kernel[grid](*args)` binds the arguments, derives a specialization key from
them (dtypes, 16-byte alignment of every pointer) and looks the compiled kernel
up, on every call: 10-20 us of Python per launch, more than many kernels run.
Weld's kernels take only pointers and constexpr block sizes (sizes are baked
into the source), so everything in that key is known when the wrapper is
generated except the alignment of the graph's inputs, which the wrapper checks
once per call (falling back to the JIT launch when an input is misaligned).

    jobs = [CompileJob(source, fn, arg_dtypes, aligned, config, device), ...]
    kernels = compile_kernels(jobs)          # in a thread pool; identical jobs compile once
    futures = submit_kernels(jobs)           # the same, without waiting
    launch, function, leading = launch_handles(kernels[0])
    launch(grid, 1, 1, stream, function, *leading, *pointers, *constexprs)

Triton's compiler spends most of its time in C++ passes and in ptxas, outside
the GIL, so threads compile kernels in parallel. This relies on the launcher
convention of Triton 3.3 and later (`CompiledKernel.run` takes every argument,
constexprs included, after the launch metadata and hooks); `fast_launch_available`
says whether this Triton has it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("torchweld.weld")

ALIGNMENT = 16  # bytes; Triton specializes pointers divisible by this (tt.divisibility)
CONSTEXPRS = ("XBLOCK", "RBLOCK")  # weld kernels' constexpr parameters, after the pointers


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel to compile: its source text (the dedupe key), its JIT function,
    the dtype and alignment of each pointer argument, the launch config
    (XBLOCK, RBLOCK, num_warps, ...) and the device."""

    source: str
    fn: object = dataclasses.field(compare=False, hash=False)
    arg_dtypes: tuple
    aligned: tuple
    config: tuple  # sorted (name, value) pairs
    device: torch.device

    @property
    def key(self) -> tuple:
        return (self.source, self.arg_dtypes, self.aligned, self.config, str(self.device))


_compiled: dict[tuple, Future] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        workers = int(os.environ.get("TORCHWELD_COMPILE_THREADS", 0)) or min(32, os.cpu_count() or 1)
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchweld-triton")
    return _pool


def fast_launch_available(device: torch.device) -> bool:
    """Whether kernels on `device` can be compiled ahead of time and launched directly."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    try:
        import triton
        from triton import knobs  # noqa: F401 - present from Triton 3.4, with the launcher convention
    except ImportError:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 4)


def submit_kernels(jobs: list[CompileJob]) -> list[Future]:
    """Start compiling `jobs` in the thread pool; a job seen before in this process
    (same source, dtypes, alignment, config, device) shares the first one's future."""
    futures = []
    with _lock:
        for job in jobs:
            future = _compiled.get(job.key)
            if future is None:
                future = _executor().submit(_compile, job, _dummy_arguments(job))
                _compiled[job.key] = future
            futures.append(future)
    return futures


def compile_kernels(jobs: list[CompileJob]) -> list[object]:
    """The CompiledKernel of each job, compiled in parallel (see submit_kernels)."""
    return [future.result() for future in submit_kernels(jobs)]


def _dummy_arguments(job: CompileJob) -> list[torch.Tensor]:
    """One small tensor per pointer argument, aligned or deliberately not, so that
    Triton's own specialization sees what the real arguments will be."""
    args = []
    for dtype, aligned in zip(job.arg_dtypes, job.aligned):
        if aligned:
            args.append(torch.empty(ALIGNMENT, dtype=dtype, device=job.device))
        else:
            t = torch.empty(2 * ALIGNMENT, dtype=dtype, device=job.device)
            args.append(t[1:])  # an itemsize past an aligned start: not 16-byte aligned (itemsize < 16)
    return args


def _compile(job: CompileJob, args: list[torch.Tensor]) -> object:
    config = dict(job.config)
    with torch.cuda.device(job.device):
        kernel = job.fn.warmup(*args, grid=(1,), **config)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        try:  # build its launcher (a C extension, compiled per signature) and load it here, in parallel
            kernel._init_handles()
        except Exception as e:  # noqa: BLE001 - launch_handles does it again in the caller's thread
            log.debug("loading a Triton kernel in a compile thread failed: %s", e)
    return kernel


def launch_handles(kernel) -> tuple[object, object, tuple]:
    """(launch, function, leading) of a CompiledKernel, loaded onto the current device: a
    launch is `launch(grid_x, grid_y, grid_z, stream, function, *leading, *pointers, *constexprs)`.

    `kernel.run` is Triton's launcher object, whose Python `__call__` works out scratch
    buffers on every launch before calling the compiled C launcher. For a kernel that
    needs no scratch memory (weld's never do), under a Triton whose C launcher's
    arguments are known here, the C launcher is called directly."""
    run = kernel.run  # loads the binary (CompiledKernel._init_handles)
    standard = (kernel.packed_metadata, None, None, None)  # launch metadata, enter and exit hooks
    if _direct_launch_form() == "3.6" and not _needs_scratch(run):
        return run.launch, kernel.function, (run.launch_cooperative_grid, run.launch_pdl, None, None) + standard
    return run, kernel.function, standard


def _direct_launch_form() -> str | None:
    """The argument convention of Triton's C launcher, for the versions whose convention is known:
    3.6 takes (grid, stream, function, cooperative, pdl, global scratch, profile scratch, metadata,
    launch metadata, enter hook, exit hook, *arguments)."""
    import triton

    return "3.6" if triton.__version__.split(".")[:2] == ["3", "6"] else None


def _needs_scratch(launcher) -> bool:
    return any(getattr(launcher, attr, 1) != 0 for attr in ("global_scratch_size", "profile_scratch_size"))


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGNMENT == 0
