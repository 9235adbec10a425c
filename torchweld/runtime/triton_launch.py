"""Compile weld's Triton kernels ahead of time, several at once, and launch them
without Triton's per-call argument binding.

`kernel[grid](*args)` binds the arguments, derives a specialization key from
them (dtypes, 16-byte alignment of every pointer) and looks the compiled kernel
up, on every call: 10-20 us of Python per launch, more than many kernels run.
Weld's kernels take pointers, constexpr block sizes and at most a size-generic
kernel's element count (other sizes are baked into the source), so everything in
that key is known when the wrapper is generated except the alignment of the graph's
inputs, which the wrapper checks once per call (falling back to the JIT launch when
an input is misaligned).

    jobs = [CompileJob(source, fn, arg_dtypes, aligned, config, device, ints), ...]
    handles = compile_kernels(jobs)          # in worker processes and threads; identical jobs compile once
    futures = submit_kernels(jobs)           # the same, without waiting
    h = handles[0]
    h.launch(grid, 1, 1, stream, h.function, *h.leading, *pointers, *h.passed(ints), *h.trailing)

Where Triton allows it and a graph brings many new kernels (tuning.workers_from), worker
processes (triton_workers.py) compile each kernel into Triton's disk cache first:
Triton's front end is Python and holds the GIL, so threads alone compile little in
parallel. The threads then load each kernel (from the cache, or compiling it
themselves where a worker failed); their C++ passes and ptxas run outside the GIL.
Loaded kernels launch through torchweld's own C launcher under Triton 3.6
(`launch_handle`). This relies on the launcher convention of Triton 3.3 and later (`CompiledKernel.run` takes every argument,
constexprs included, after the launch metadata and hooks); `fast_launch_available`
says whether this Triton has it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from torchweld import config as torchweld_config
from torchweld import timing
from torchweld.c_extension import ExtensionBuildError, load_extension, loaded_once
from torchweld.runtime import triton_binaries
from torchweld.runtime.triton_worker_main import binary_of
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")

ALIGNMENT = 16  # bytes; Triton specializes pointers divisible by this (tt.divisibility)
CONSTEXPRS = ("XBLOCK", "RBLOCK")  # weld kernels' constexpr parameters, after the pointers


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel to compile: its source text (the dedupe key), its JIT function (a
    triton_loader.GeneratedKernel, which imports it when first used), the dtype and alignment
    of each pointer argument, the launch config (XBLOCK, RBLOCK, num_warps, ...), the device,
    a value of each integer argument's specialization class (specialization_class), the
    names of the function's parameters (pointers, integers, then CONSTEXPRS), and those of
    its integers under do_not_specialize."""

    source: str
    fn: object = dataclasses.field(compare=False, hash=False)
    arg_dtypes: tuple
    aligned: tuple
    config: tuple  # sorted (name, value) pairs
    device: torch.device
    ints: tuple = ()
    params: tuple = dataclasses.field(default=(), compare=False, hash=False)
    unspecialized: tuple = dataclasses.field(default=(), compare=False, hash=False)  # do_not_specialize's names

    @property
    def key(self) -> tuple:
        return (self.source, self.arg_dtypes, self.aligned, self.config, str(self.device), self.ints)


def specialization_class(values: tuple[int, ...], unspecialized: tuple[bool, ...] = ()) -> tuple[int, ...]:
    """One representative of each integer argument's class under Triton's specialization,
    which compiles a kernel apart for an int divisible by 16, for 1 (a constant) and for
    an int outside int32 (an int64): 16 or 17, 1, 2**32 + 16 or 2**32 + 17. An argument
    flagged in `unspecialized` (the kernel's `do_not_specialize`) has its type alone: 17 or
    2**32 + 17. Kernels of sizes in one class are one compile."""
    def representative(v: int, plain: bool) -> int:
        if v == 1 and not plain:
            return 1
        return (16 if v % 16 == 0 and not plain else 17) + (0 if -2**31 <= v < 2**31 else 2**32)

    flags = tuple(unspecialized) + (False,) * (len(values) - len(unspecialized))
    return tuple(map(representative, values, flags))


_compiled: dict[tuple, Future] = {}
_lock = threading.Lock()
_pools: dict[bool, ThreadPoolExecutor] = {}


def _executor(loading: bool) -> ThreadPoolExecutor:
    """The threads that load worker-compiled kernels (`loading`: tuning.loading_threads, or
    config.loading_threads), or those that compile kernels themselves: one per core
    up to 32, or config.compile_threads."""
    pool = _pools.get(loading)
    if pool is None:
        if loading:
            count = torchweld_config.loading_threads or tuning.loading_threads
        else:
            count = torchweld_config.compile_threads or min(32, os.cpu_count() or 1)
        pool = _pools[loading] = ThreadPoolExecutor(max_workers=count, thread_name_prefix="torchweld-triton")
    return pool


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


@loaded_once
def triton_driver():
    """Triton's active driver. Triton creates it at first use, and creating it builds Triton's C
    utilities with the C compiler where its cache lacks them (0.3 s of a cold compile's first
    kernel on the H100 host); the weld backend starts this in a thread before a CUDA call is
    captured (or at its entry), and kernels wait for that one creation rather than racing it."""
    from triton.runtime import driver

    active = driver.active
    active.get_current_target()
    return active


def submit_kernels(jobs: list[CompileJob], batch: int | None = None) -> list[Future]:
    """Start compiling `jobs` in the thread pool; a job seen before in this process
    (same source, dtypes, alignment, config, device) shares the first one's future.
    `batch`: how many kernels the graph has when `jobs` is part of them (handed over
    one by one as they are rendered), which decides whether worker processes compile them."""
    futures = []
    with _lock:
        new = {job.key for job in jobs if job.key not in _compiled}
        count = len(new) if batch is None else batch
        use_workers = bool(new) and (count >= tuning.workers_from or (count > 1 and _workers_running()))
        for job in jobs:
            future = _compiled.get(job.key)
            if future is None:
                binary = triton_binaries.stored(job)  # compiled by an earlier process: loaded, not compiled
                if binary is not None:
                    future = _executor(loading=True).submit(_load_stored, job, binary)
                else:
                    ahead = _compile_in_worker(job) if use_workers else None
                    future = _executor(loading=ahead is not None).submit(_compile, job, ahead)
                _compiled[job.key] = future
            futures.append(future)
    return futures


def _load_stored(job: CompileJob, binary: dict) -> "LaunchHandle":
    """`job`'s kernel from the binary an earlier process kept (triton_binaries.py); compiled
    as any other where this process cannot launch it itself."""
    try:
        with torch.cuda.device(job.device), timing.phase("weld.triton_compile.threads.load_binary"):
            handle = handle_from_binary(binary, job.device)
    except Exception as e:  # noqa: BLE001 - compiled instead
        log.debug("cannot load the kept binary of %s, compiling it: %s", binary.get("name"), e)
        handle = None
    return handle if handle is not None else _compile(job)


def compile_kernels(jobs: list[CompileJob]) -> list["LaunchHandle"]:
    """Each job's kernel compiled (in parallel, see submit_kernels) and loaded."""
    return [future.result() for future in submit_kernels(jobs)]


def _dummy_arguments(job: CompileJob) -> list:
    """One small tensor per pointer argument, aligned or deliberately not, then the
    integer arguments' representatives, so that Triton's own specialization sees what
    the real arguments will be."""
    args: list = []
    for dtype, aligned in zip(job.arg_dtypes, job.aligned):
        if aligned:
            args.append(torch.empty(ALIGNMENT, dtype=dtype, device=job.device))
        else:
            t = torch.empty(2 * ALIGNMENT, dtype=dtype, device=job.device)
            args.append(t[1:])  # an itemsize past an aligned start: not 16-byte aligned (itemsize < 16)
    return args + list(job.ints)


def _workers_running() -> bool:
    from torchweld.runtime import triton_workers

    return triton_workers.running_pool() is not None


def _compile_in_worker(job: CompileJob) -> Future | None:
    """A worker's compile of `job` (None where there is none to ask). Its specialization is
    written here where this Triton's format is known (triton_workers.written_specialization),
    without importing the kernel or running Triton's JIT; else the JIT is run up to its compile."""
    from torchweld.runtime import triton_workers

    pool = triton_workers.worker_pool()
    if pool is None:
        return None
    try:
        with torch.cuda.device(job.device), timing.phase("weld.triton_compile.specialize"):
            target = triton_driver().get_current_target()
            data = triton_workers.written_specialization(job.params, job.arg_dtypes, job.aligned, job.ints,
                                                         dict(job.config), job.unspecialized)
            if data is None:
                data = triton_workers.specialization_data(job.fn, _dummy_arguments(job), dict(job.config))
    except Exception as e:  # noqa: BLE001 - the thread compiles it as before
        log.debug("cannot hand a Triton kernel to a worker: %s", e)
        return None
    if data is None:
        return None
    fn = job.fn
    return fn.when_written(lambda: pool.submit(triton_workers.compile_request(fn.module_name, fn.path, fn.name,
                                                                              data, target)))


def _compile(job: CompileJob, ahead: Future | None = None) -> "LaunchHandle":
    """Compile one kernel and load it. After a worker's compile `ahead`: load the binary it
    sent back, or, where this process cannot launch that binary itself, load the kernel from
    Triton's cache, which the worker filled."""
    if ahead is not None:
        start = time.perf_counter()
        binary = None
        try:
            reply = ahead.result(timeout=tuning.worker_timeout_s)
            for part, s in reply["seconds"].items():
                timing.record(f"weld.triton_compile.workers.{part}", s, job.fn.name)
            binary = reply.get("binary")
        except Exception as e:  # noqa: BLE001 - compiled here instead
            log.debug("a Triton compile worker failed, compiling in this process: %s", e)
        timing.record("weld.triton_compile.threads.wait_for_worker", time.perf_counter() - start, job.fn.name)
        if binary is not None:
            try:
                with torch.cuda.device(job.device), timing.phase("weld.triton_compile.threads.load_binary"):
                    handle = handle_from_binary(binary, job.device)
            except Exception as e:  # noqa: BLE001 - loaded through Triton instead
                log.debug("cannot load a worker's binary of %s, loading it through Triton: %s", binary.get("name"), e)
                handle = None
            if handle is not None:
                triton_binaries.store(job, binary)
                return handle
    config = dict(job.config)
    triton_driver()  # created once, not raced by this JIT's own first use
    from torchweld.runtime import triton_workers

    triton_workers.install_key()  # hashed once, not raced by this compile's cache key
    with torch.cuda.device(job.device), timing.phase("weld.triton_compile.threads.kernel"):
        kernel = job.fn.warmup(*_dummy_arguments(job), grid=(1,), **config)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        handle = launch_handle(kernel, tuple(config[c] for c in CONSTEXPRS), job.device)
    # weld's own launch of the binary: one a later process can load so (triton_binaries.py)
    binary = binary_of(kernel) if not handle.takes_constants else None
    if binary is not None:
        triton_binaries.store(job, binary)
    return handle


@dataclasses.dataclass(frozen=True)
class LaunchHandle:
    """How the wrapper launches one loaded kernel:
    `launch(grid_x, 1, 1, stream, function, *leading, *pointers, *handle.passed(ints), *trailing)`.

    Triton makes an integer argument of value 1 a constant of the compiled kernel. Its own
    launchers still take a value in that place (and ignore it, as they do the trailing
    constexprs); weld's launcher passes the binary's parameters alone, so `passed` drops it."""

    launch: object
    function: object
    leading: tuple
    trailing: tuple
    takes_constants: bool = True

    def passed(self, ints: tuple[int, ...]) -> tuple[int, ...]:
        """The integer arguments this launcher is handed: without Triton's constants where it takes none."""
        return ints if self.takes_constants else tuple(v for v in ints if v != 1)


SCRATCH_POINTERS = 2  # Triton 3.6 kernels take a global and a profile scratch pointer after their own


def launch_handle(kernel, constexprs: tuple, device: torch.device) -> LaunchHandle:
    """Load a CompiledKernel onto `device` and say how to launch it.

    Under Triton 3.6, a kernel that needs nothing but its pointers (no scratch memory,
    one CTA, no cooperative or programmatic launch: weld's kernels) is loaded here and
    launched through torchweld's one C launcher (kernel_launch.c), so Triton never builds
    a launcher for it (a C compile per kernel signature). Otherwise `kernel.run` is
    Triton's launcher object, whose Python `__call__` works out scratch buffers on every
    launch before calling its compiled C launcher; for a kernel that needs no scratch
    memory under a Triton whose C launcher's arguments are known here, that C launcher
    is called directly."""
    own = _own_launch(kernel.name, kernel.kernel, kernel.metadata, device)
    if own is not None:
        return own
    run = kernel.run  # Triton builds the launcher and loads the binary (CompiledKernel._init_handles)
    standard = (kernel.packed_metadata, None, None, None)  # launch metadata, enter and exit hooks
    if _direct_launch_form() == "3.6" and not _needs_scratch(run):
        leading = (run.launch_cooperative_grid, run.launch_pdl, None, None) + standard
        return LaunchHandle(run.launch, kernel.function, leading, constexprs)
    return LaunchHandle(run, kernel.function, standard, constexprs)


def handle_from_binary(binary: dict, device: torch.device) -> LaunchHandle | None:
    """The launch of a worker's compiled kernel (triton_worker_main's reply "binary") through
    weld's own launcher, without Triton's in-process compile; None where it needs Triton's
    launcher (see _own_launch)."""
    return _own_launch(binary["name"], binary["cubin"], types.SimpleNamespace(**binary), device)


def _own_launch(name: str, cubin: bytes, metadata, device: torch.device) -> LaunchHandle | None:
    """The launch of binary `cubin` (function `name`, `metadata` the kernel's) through weld's
    own launcher: under Triton 3.6, for a plain launch, where the launcher extension is built
    and the binary fits the device; None otherwise."""
    if _direct_launch_form() != "3.6" or not _plain_launch(metadata):
        return None
    extension = kernel_launcher()
    if extension is None:
        return None
    function = _load_binary(name, cubin, metadata, device)
    if function is None:
        return None
    return LaunchHandle(extension.launch, function, (metadata.num_warps * 32, metadata.shared),
                        (0,) * SCRATCH_POINTERS, takes_constants=False)


def _plain_launch(metadata) -> bool:
    return (getattr(metadata, "num_ctas", 1) == 1 and not getattr(metadata, "launch_cooperative_grid", True)
            and not getattr(metadata, "launch_pdl", True) and not getattr(metadata, "tensordesc_meta", None)
            and getattr(metadata, "global_scratch_size", 1) == 0 and getattr(metadata, "profile_scratch_size", 1) == 0)


def _load_binary(name: str, cubin: bytes, metadata, device: torch.device) -> int | None:
    """The CUfunction `name` of `cubin` loaded on `device`, or None where it does not fit there
    (`metadata`: the kernel's, for its shared memory and warps)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    utils = triton_driver().utils
    if metadata.shared > _max_shared_memory(index):
        return None
    _, function, _, _, max_threads = utils.load_binary(name, cubin, metadata.shared, index)
    return function if metadata.num_warps * 32 <= max_threads else None


@functools.lru_cache(maxsize=None)
def _max_shared_memory(index: int) -> int:
    return triton_driver().utils.get_device_properties(index)["max_shared_mem"]


def ensure_context_function():
    """`ensure_context(device)` for a wrapper that launches kernels itself: the primary
    context made current on a thread that has none (autograd's device thread), as
    Triton's own launchers do before they launch."""
    extension = kernel_launcher()
    return extension.ensure_context if extension is not None else (lambda device: None)


@loaded_once
def kernel_launcher():
    """The kernel_launch extension, or None (logged once) where it cannot be built."""
    try:
        return load_extension(Path(__file__).with_name("kernel_launch.c"), "torchweld.runtime.kernel_launch",
                              "launcher")
    except (ExtensionBuildError, OSError, ImportError) as e:
        log.warning("torchweld: kernels launch through Triton's launchers; torchweld's own cannot be built: %s", e)
        return None


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
