"""Compile generated C++ with the system g++ (-O3 -march=native -fopenmp) into a
shared library cached by a hash of the source, the command and the CPU that
-march=native stands for here (runtime/native_target.py), and load its kernels through
ctypes. The library is a torchweld.disk_cache library: its seal is checked before dlopen."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import threading

from torchweld import config
from torchweld.disk_cache import LIBRARY_FORMAT, compiler_build, content_hash, library, load_library, write_source
from torchweld.runtime.native_target import native_target

# -ffp-contract=off: `x * y + z` of two ops rounds twice, as eager's two kernels do (g++'s default
# fused them into one fma: a quarter of the elements differed from eager's in the last bit); the
# fmas eager's kernels make inside one op are explicit (ir.Op.FMA). Cost: bench/DECISIONS.md#no-fp-contraction
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
            "-shared", "-fPIC", "-std=c++17", "-w"]

if ctypes.util.find_library("mvec"):  # glibc's vector math: lets loops calling expf etc. vectorize
    CXXFLAGS += ["-DTW_MVEC"]
    LDLIBS = ["-lmvec"]
else:
    LDLIBS = []

_locks: dict[str, threading.Lock] = {}  # one per source: threads building others run at once
_locks_lock = threading.Lock()


class CppCompileError(RuntimeError):
    pass


def build(source: str) -> str:
    """The path of the shared library built from `source` (built once per content and CPU)."""
    key = library_key(source)
    with _lock_for(key), _cache_errors():
        return library("cpp", f"k{key}.so", key, lambda path: _compile(source, key, path))[0]


def load_kernels(source: str, names: list[str], n_args: dict[str, tuple[int, int]]) -> tuple[dict, str]:
    """{name: ctypes function taking data pointers, then int64 sizes} and the library's path;
    `n_args`: each kernel's (pointers, sizes)."""
    key = library_key(source)
    with _lock_for(key), _cache_errors():
        lib = load_library("cpp", f"k{key}.so", key, lambda path: _compile(source, key, path), _load_library)
    kernels = {}
    for name in names:
        fn = getattr(lib, name)
        pointers, sizes = n_args[name]
        fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes
        fn.restype = None
        kernels[name] = fn
    return kernels, lib._name


def library_key(source: str) -> str:
    return content_hash(source, config.cxx, " ".join(CXXFLAGS), native_target(config.cxx), LIBRARY_FORMAT)


def _lock_for(key: str) -> threading.Lock:
    """One lock per library: a training step's forward and backward (compiled ahead, in a
    thread) build different ones at once, and the same one once."""
    with _locks_lock:
        return _locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def _cache_errors():
    """A cache that cannot be written or a library that will not load is a CppCompileError
    (the weld backend then runs the graph eagerly, saying why)."""
    try:
        yield
    except OSError as e:
        raise CppCompileError(f"cannot build or load the kernels' library: {e}") from e


def _compile(source: str, key: str, path: str) -> None:
    if shutil.which(config.cxx) is None:
        raise CppCompileError(f"no C++ compiler {config.cxx!r} on PATH; install g++ or set CXX")
    try:
        source_path = write_source("cpp", f"k{key}.cpp", source)
    except OSError as e:  # not the library's folder refusing it: no folder takes the source
        raise CppCompileError(f"cannot write the kernels' source to torchweld's cache: {e}") from e
    compiler_build([config.cxx, *CXXFLAGS, source_path, *LDLIBS], CppCompileError)(path)


@functools.lru_cache(maxsize=None)
def _load_library(so_path: str) -> ctypes.CDLL:
    return ctypes.CDLL(so_path)
