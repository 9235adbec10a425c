"""Write generated Triton source to a file cached by its hash, and import its kernels when first used.

    kernel = GeneratedKernel(module_source, "k_0123abcd")   # its file is written in a background thread
    kernel.module_name, kernel.path, kernel.name            # what a compile worker imports instead (path: once written)
    kernel.when_written(lambda: pool.submit(...))           # a Future of what that returns, once the file is there
    kernel[(grid,)](*args, XBLOCK=...)                      # imports the module, then Triton's JIT launch

Where worker processes compile the kernels and the parent launches their binaries
(runtime/triton_launch.py), the parent never needs the JIT function: importing each
module (Triton's decorator reads and hashes the source) cost ~3.5 ms of the parent's
CPU per kernel. It is imported only for what needs it: Triton's JIT launch (a
misaligned input, Triton's interpreter), a compile in this process, or autotuning.
Nor does the thread that renders kernels write their files: each system call there let
another compiling thread take the GIL for up to its 5 ms switch interval (~6.5 ms of
wall time a kernel while densenet121's forward and backward compiled at once).
The file is a torchweld.disk_cache source: one that holds other text is written again,
and where the cache directory refuses the write, it lies in this process's private one.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from torchweld.disk_cache import compiled_code, content_hash, write_source

_import_lock = threading.Lock()
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchweld-write")


def module_name(source: str) -> str:
    """The module name of `source`, and its file's in the cache: named by its hash."""
    return f"torchweld_triton_{content_hash(source)}"


def write_module(name: str, source: str) -> str:
    """The path of the cache file holding module `name`'s `source` (written if missing or different)."""
    return write_source("triton", f"t{name.rpartition('_')[2]}.py", source)


def import_module(name: str, path: str):
    """The module in file `path`, imported once under `name` (Triton's jit needs a real file to read)."""
    with _import_lock:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        with open(path, encoding="utf-8") as f:  # (its code from the disk cache: no .pyc needed)
            exec(compiled_code(f.read(), path), module.__dict__)
        sys.modules[name] = module
        return module


def _chained(first: Future, then: Callable[[], Future]) -> Future:
    """A Future of the result of `then()`'s Future, `then` called once `first` is done."""
    result: Future = Future()

    def copy(inner: Future) -> None:
        error = inner.exception()
        result.set_exception(error) if error is not None else result.set_result(inner.result())

    def start(_: Future) -> None:
        try:
            then().add_done_callback(copy)
        except Exception as e:  # noqa: BLE001 - the caller's Future carries it
            result.set_exception(e)

    first.add_done_callback(start)
    return result


class GeneratedKernel:
    """Triton kernel `name` of the generated module `source`, imported at first use.

    Stands in for the JIT function: `kernel[grid](...)`, and any attribute of the JIT
    function (`warmup`, `run`, ...), import the module first. `src` is the module's
    source, which identifies the kernel without importing it."""

    def __init__(self, source: str, name: str):
        self.src = source
        self.name = name
        self.module_name = module_name(source)
        self.written = _writer.submit(write_module, self.module_name, source)  # a Future of the file's path
        self._function = None

    @property
    def path(self) -> str:
        """The module's file, once written."""
        return self.written.result()

    def when_written(self, then: Callable[[], Future]) -> Future:
        """A Future of the result of `then()`'s Future, called once the module's file is written."""
        return _chained(self.written, then)

    @property
    def jit_function(self):
        if self._function is None:
            self._function = getattr(import_module(self.module_name, self.path), self.name)
        return self._function

    def __getitem__(self, grid):
        return self.jit_function[grid]

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("_function", "written"):  # copy/pickle probes, and before __init__ ran
            raise AttributeError(attr)
        return getattr(self.jit_function, attr)

    def __repr__(self) -> str:
        return f"GeneratedKernel({self.name} of {self.module_name})"
