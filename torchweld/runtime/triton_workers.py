"""A pool of Triton compile worker processes (triton_worker_main.py) and the parent's half
of their work: the specialization Triton would compile, and handing it to a worker.

Triton's front end (the kernel's AST to its first IR) is Python and holds the GIL:
16 threads compiling resnet50's 19 kernels took 2.7 s where one thread took 4.3 s.
Workers compile each kernel (into Triton's disk cache too) and send its binary back,
which the parent loads (triton_launch). Nothing depends on a worker succeeding: if one
fails or is missing, the parent compiles that kernel itself.

    pool = worker_pool()                               # None: no workers here
    data = written_specialization(params, dtypes, aligned, ints, config)   # Triton 3.6; else
    data = specialization_data(fn, args, config)       # what fn.warmup(*args, **config) would compile
    future = pool.submit(compile_request(module_name, path, fn_name, data, target))  # a Future

The pool starts its processes on first use, one per core up to 16, or
`TORCHWELD_COMPILE_WORKERS` (0: none).
Workers run as `python triton_worker_main.py`, not through multiprocessing, which
would re-run the user's script in every worker.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from torchweld import config as torchweld_config
from torchweld.c_extension import loaded_once
from torchweld.runtime.triton_worker_main import read_message, write_message
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_worker_main.py")


def worker_count() -> int:
    if torchweld_config.compile_workers is not None:
        return max(0, torchweld_config.compile_workers)
    return min(tuning.max_workers, os.cpu_count() or 1)


def _niceness_arguments() -> list[str]:
    """The worker's command-line arguments for config.worker_niceness (the worker reads no config)."""
    return ["--niceness", str(torchweld_config.worker_niceness)]


class WorkerPool:
    """`count` worker processes fed from one queue; each has a thread that sends it one request at a time.

    A worker that dies (killed for memory, a crash in a compile) fails the request it had and
    is replaced by a new process, up to `count` replacements in the pool's life; past that its
    thread stops, and the last thread to stop fails every request from then on, so none waits."""

    def __init__(self, count: int, script: str = WORKER_SCRIPT):
        self._script = script
        self._requests: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()
        self._restarts_left = count
        self._serving = count  # threads still serving requests
        self._first: subprocess.Popen | None = None  # the process the workers were forked from
        forked = self._fork(count) if count > 1 and hasattr(os, "fork") else []
        for slot in range(count):
            self._processes.append(forked[slot] if forked else self._start())
            threading.Thread(target=self._serve, args=(slot,), daemon=True, name="torchweld-triton-worker").start()

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, self._script, *_niceness_arguments()], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        write_message(process.stdin, list(sys.path))
        return process

    def _fork(self, count: int) -> list[ForkedWorker]:
        """`count` workers forked from one process after it has imported Triton (one import,
        not `count` at once), each with a request and a reply pipe; [] where that process
        cannot start (the pool then starts each worker on its own)."""
        ends, passed = [], []
        for _ in range(count):
            request_read, request_write = os.pipe()
            reply_read, reply_write = os.pipe()
            ends.append((request_write, reply_read))
            passed += [request_read, reply_write]
        try:
            self._first = subprocess.Popen([sys.executable, self._script, "--fork", ",".join(map(str, passed)),
                                            *_niceness_arguments()],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=passed)
        except OSError as e:
            log.debug("cannot start the Triton compile workers' first process: %s", e)
            for fd in passed + [fd for pair in ends for fd in pair]:
                os.close(fd)
            return []
        for fd in passed:
            os.close(fd)
        write_message(self._first.stdin, list(sys.path))
        pids = _Pids(self._first)
        return [ForkedWorker(os.fdopen(w, "wb"), os.fdopen(r, "rb"), pids, slot) for slot, (w, r) in enumerate(ends)]

    def submit(self, request: tuple) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError("the Triton worker pool is closed"))
        else:
            self._requests.put((next(self._ids), request, future))
        return future

    def _serve(self, slot: int) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            job_id, request, future = item
            process = self._processes[slot]
            try:
                write_message(process.stdin, (job_id, request))
                reply = read_message(process.stdout)
            except Exception:  # noqa: BLE001 - a broken pipe or a truncated reply: the worker is gone
                reply = None
            if reply is None:  # the worker died: its request fails (the parent compiles that kernel itself)
                process.kill()
                code = process.wait()
                log.debug("a Triton compile worker exited with %s", code)
                future.set_exception(RuntimeError(f"a Triton compile worker exited ({code})"))
                if not self._replace(slot):
                    return
                continue
            _, ok, value = reply
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))

    def _replace(self, slot: int) -> bool:
        """A new process in `slot` if the pool may still start one; else this thread stops
        serving, and if it was the last, it fails every request from then on."""
        with self._lock:
            may_restart = self._restarts_left > 0 and not self._closed
            self._restarts_left -= may_restart
        if may_restart:
            try:
                self._processes[slot] = self._start()
                return True
            except OSError as e:
                log.debug("cannot restart a Triton compile worker: %s", e)
        with self._lock:
            self._serving -= 1
            last = self._serving == 0
        if last:
            while (item := self._requests.get()) is not None:
                item[2].set_exception(RuntimeError("every Triton compile worker exited"))
        return False

    def close(self) -> None:
        self._closed = True
        for _ in self._processes:
            self._requests.put(None)
        for process in [*self._processes, *([self._first] if self._first else [])]:
            try:
                process.stdin.close()  # the worker exits at the end of its input
                process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()


class _Pids:
    """The forked workers' pids, which their first process writes once it has forked them
    (read when first asked: only killing or waiting for a worker needs them)."""

    def __init__(self, first: subprocess.Popen):
        self._first = first
        self._lock = threading.Lock()
        self._pids: list[int] | None = None

    def __getitem__(self, slot: int) -> int | None:
        with self._lock:
            if self._pids is None:
                try:
                    self._pids = read_message(self._first.stdout) or []
                except Exception:  # noqa: BLE001 - the first process died before forking
                    self._pids = []
        return self._pids[slot] if slot < len(self._pids) else None


class ForkedWorker:
    """A worker forked by the pool's first process: its pipes, and what the pool asks of a
    subprocess.Popen (kill, poll, wait) done through its pid."""

    def __init__(self, stdin, stdout, pids: _Pids, slot: int):
        self.stdin, self.stdout = stdin, stdout
        self._pids, self._slot = pids, slot

    @property
    def pid(self) -> int | None:
        """The worker's pid (None where its first process died before forking it)."""
        return self._pids[self._slot]

    def kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def poll(self) -> int | None:
        """None while the worker runs, else 0 (its exit status belongs to the process that reaps it)."""
        if self.pid is None:
            return 0
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 0
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("torchweld Triton compile worker", timeout)
            time.sleep(0.01)
        return code


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def worker_pool() -> WorkerPool | None:
    """The process's pool, started on first call; None where workers are off or cannot start."""
    global _pool
    with _pool_lock:
        if _pool is None:
            count = worker_count()
            if count == 0 or not workers_supported():
                return None
            try:
                _pool = WorkerPool(count)
            except OSError as e:
                log.debug("cannot start Triton compile workers: %s", e)
                return None
            atexit.register(_pool.close)
        return _pool


def start_in_background() -> None:
    """Start the pool in a thread, so that its processes import Triton while the graph is
    traced and lowered, and every kernel of the graph goes to them (submit_kernels)."""
    if _pool is None and worker_count() > 0:
        threading.Thread(target=worker_pool, daemon=True, name="torchweld-start-workers").start()


def running_pool() -> WorkerPool | None:
    """The process's pool if it has been started (worker_pool starts it)."""
    return _pool


def workers_supported() -> bool:
    """Whether this Triton has the two pieces the workers rely on: the JIT's cache hook, called
    with the serialized specialization before each compile, and that serialization's format
    (`JITFunction.preload`, which reads it)."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")


_hook_lock = threading.Lock()


def specialization_data(fn, args: list, config: dict) -> str | None:
    """The serialized specialization `fn.warmup(*args, **config)` would compile, found
    without compiling it; None if this process has that kernel compiled already."""
    from triton import knobs

    captured: list[str] = []
    this_thread = threading.get_ident()

    def hook(*, compile: dict, **_) -> bool:
        # The hook is global to the process: compiles running in other threads meanwhile
        # (the pool's, of the kernels handed out before this one) go ahead as usual.
        if threading.get_ident() != this_thread:
            return False
        captured.append(compile["specialization_data"])
        return True  # skip the compile

    with _hook_lock:
        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        try:
            fn.warmup(*args, grid=(1,), **config)
        finally:
            knobs.runtime.jit_cache_hook = previous
    return captured[0] if captured else None


def compile_request(module_name: str, module_path: str, fn_name: str, data: str, target) -> tuple:
    """The worker request that compiles kernel `fn_name` of module `module_name` (file
    `module_path`) for specialization `data` on `target`."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
    return ("compile", module_name, module_path, fn_name, data,
            (target.backend, target.arch, target.warp_size), env, install_key())


# Triton's names of the pointer types of torch dtypes (triton._utils.canonicalize_ptr_dtype)
POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64",
                 "int64": "*i64", "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*u1"}
WRITTEN_FORMAT = ("3", "6")  # the Triton whose serialized specialization written_specialization writes


def written_specialization(params: tuple, dtypes: tuple, aligned: tuple, ints: tuple, config: dict,
                           unspecialized: tuple = ()) -> str | None:
    """The serialized specialization that Triton's JIT would make of a weld kernel called with
    pointers of `dtypes` (16-byte `aligned` or not), then the integers `ints` (those named in
    `unspecialized` under the kernel's do_not_specialize: typed, with no attributes), then the
    constexprs of `config` (its other entries are compile options, num_warps...): what
    `specialization_data` finds by running the JIT, written here without importing the kernel's
    module or running Triton's JIT (whose first use in a process imported Triton's Gluon
    front end: 0.17 s of a first call on the H100 host). None where this Triton's format is not
    the one written here (Triton 3.6: its specialize.cc), or a dtype has no name here; a
    CUDA test checks it against the JIT's own."""
    import triton
    from triton import knobs

    from torchweld.runtime.triton_launch import CONSTEXPRS

    if (tuple(triton.__version__.split(".")[:2]) != WRITTEN_FORMAT
            or len(params) != len(dtypes) + len(ints) + len(CONSTEXPRS)):
        return None
    signature, constants, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, (dtype, is_aligned) in enumerate(zip(dtypes, aligned)):
        type_name = POINTER_TYPES.get(str(dtype).removeprefix("torch."))
        if type_name is None:
            return None
        signature[params[i]] = type_name
        attrs[i] = divisible if is_aligned else []  # the JIT lists every argument it does not make a constant
    for i, value in enumerate(ints, start=len(dtypes)):
        if params[i] in unspecialized:
            signature[params[i]] = "i32" if -2**31 <= value < 2**31 else "i64"
            continue
        if value == 1:  # Triton makes an int of value 1 a constant
            signature[params[i]], constants[i] = "constexpr", 1
            continue
        signature[params[i]] = "i32" if -2**31 <= value < 2**31 else "i64"
        attrs[i] = divisible if value % 16 == 0 else []
    for i, name in enumerate(params[-len(CONSTEXPRS):], start=len(params) - len(CONSTEXPRS)):
        if name not in CONSTEXPRS or name not in config:
            return None
        signature[name], constants[i] = "constexpr", config[name]
    options = {k: v for k, v in config.items() if k not in CONSTEXPRS}
    options.setdefault("debug", bool(knobs.runtime.debug))  # what the JIT adds to its launch options
    options.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
    return json.dumps({"signature": signature, "constant_keys": [[i] for i in constants],
                       "constant_vals": list(constants.values()), "attrs_keys": [[i] for i in attrs],
                       "attrs_vals": list(attrs.values()), "options": options})


@loaded_once
def install_key() -> str | None:
    """Triton's key of its own installation (`triton.runtime.cache.triton_key`), part of every
    kernel's cache key: a SHA-256 of its sources and of libtriton.so (500 MB), 0.3-1 s per
    process, cached there. Workers take the parent's instead of each hashing the library
    again at its first compile (16 workers at once took ~0.6 s a kernel on an H100 host).
    None where this Triton keeps it elsewhere. Computed once: a caller meanwhile waits for
    the computation under way (`start_in_background`) instead of hashing the library again
    itself (Triton's own cache of the key is not shared by concurrent first calls)."""
    try:
        from triton.runtime import cache
    except ImportError:
        return None
    key = getattr(cache, "triton_key", None)
    return key() if callable(key) else None
