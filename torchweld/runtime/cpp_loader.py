"""Compile generated C++ with the system g++ (-O3 -march=native -fopenmp) into a
shared library cached by source hash, and load its kernels through ctypes."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import threading

from torchweld.disk_cache import cache_dir, compile_once, content_hash, write_once

CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
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
    """The path of the shared library built from `source` (built once per content)."""
    key = content_hash(source, CXX, " ".join(CXXFLAGS))
    directory = cache_dir("cpp")
    so_path = os.path.join(directory, f"k{key}.so")
    src_path = write_once(os.path.join(directory, f"k{key}.cpp"), source)
    with _locks_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:  # a training step's forward and backward (compiled ahead, in a thread) build at once
        if not os.path.exists(so_path) and shutil.which(CXX) is None:
            raise CppCompileError(f"no C++ compiler {CXX!r} on PATH; install g++ or set CXX")
        compile_once([CXX, *CXXFLAGS, src_path, *LDLIBS], so_path, CppCompileError)
    return so_path


@functools.lru_cache(maxsize=None)
def _load_library(so_path: str) -> ctypes.CDLL:
    return ctypes.CDLL(so_path)


def load_kernels(source: str, names: list[str], n_args: dict[str, int]) -> tuple[dict, str]:
    """{name: ctypes function taking data pointers} and the library's path."""
    so_path = build(source)
    lib = _load_library(so_path)
    kernels = {}
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * n_args[name]
        fn.restype = None
        kernels[name] = fn
    return kernels, so_path
