"""Every knob torchweld has, in one place; tests change them with `config.patch`.

This is the only module-level mutable state in torchweld (besides tuning.py's performance
constants, and append-only import-time registries such as the opcode table and the backend
registry), and the only module that reads environment variables: each TORCHWELD_* variable
(and CC, CXX) sets the knob it is named beside, once, when torchweld is imported. (Triton's
own TRITON_* variables are Triton's: runtime/ only passes them on to its compile workers. A
captured program's `os.environ.get(...)` is the user's code, modelled by capture/environ.py.)
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


def _int_from_env(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} must be an integer") from None

# -- capture -----------------------------------------------------------------
# compiled versions of a function for the same objects (those its guards hold by identity, such
# as a module instance; a resume function's loop position) and in all; past either, new inputs
# run eagerly (torch.compile's cache_size_limit and accumulated_cache_size_limit)
cache_size_limit: int = 8
accumulated_cache_size_limit: int = 256
suppress_errors: bool = False  # a backend that raises: run the frame eagerly with a warning
inline_depth_limit: int = 32  # nested inlined user calls before the frame gives up
# A graph captured inside DistributedDataParallel's forward is split at DDP's gradient buckets,
# each piece compiled on its own, so that all-reduces overlap the backward (capture/ddp_split.py)
optimize_ddp: bool = True
# A bug inside capture (not a known limitation): False runs the frame eagerly with a
# warning, so the user's program goes on; True raises it (the test suite sets this).
raise_internal_errors: bool = False
# How a cache entry tests its guards before each call: "c" runs them in a small C extension
# built on first use (capture/guard_eval.c), "python" as one generated Python expression
# (also what "c" falls back to, with a log line, where no C compiler or Python.h is found).
guard_evaluator: str = os.environ.get("TORCHWELD_GUARDS", "c")

# -- logs (also set by the TORCHWELD_LOGS environment variable) ---------------
# e.g. "graph_breaks,guards,+recompiles" (logs.py). None (TORCHWELD_LOGS unset): the artifacts of
# torch.compile's TORCH_LOGS that torchweld has too (graph_breaks, recompiles, recompiles_verbose as
# +recompiles, guards, graph, graph_code, output_code, bytecode); torch's others are ignored here.
logs: str | None = os.environ.get("TORCHWELD_LOGS")
torch_logs: str = os.environ.get("TORCH_LOGS", "")

# -- disk cache (torchweld/cache_root.py, torchweld/disk_cache.py) ----------------
# Where generated kernels, the libraries built from them and the guard evaluator are kept
# between processes. Empty (also TORCHWELD_CACHE_DIR="") means the default,
# ~/.cache/torchweld. Entries are written atomically and checked before use: a damaged one
# (truncated, altered, swapped, built for another CPU) is built again with one warning.
# Where the directory cannot be made or read, or belongs to another user, or a write
# there fails (read-only, deleted), this process keeps its new entries in a private
# temporary directory, removed at exit, and says so once.
cache_dir: str = os.environ.get("TORCHWELD_CACHE_DIR") or os.path.expanduser("~/.cache/torchweld")
# Where the C helpers (the guard evaluator, the kernel launcher) are built once per machine
# and user, whatever cache_dir says: a process with a new cache directory (a test, a CI job)
# finds them there instead of building them again with the C compiler (~0.5 s a first call).
# They are looked for in cache_dir first; where this directory cannot be used, they are built
# in cache_dir, without a warning. TORCHWELD_HELPERS_DIR sets it; set it to cache_dir to keep
# everything in one directory.
helpers_dir: str = os.environ.get("TORCHWELD_HELPERS_DIR") or os.path.expanduser("~/.cache/torchweld")
# Load cache files that another user owns (TORCHWELD_CACHE_TRUST_OTHER_USERS=1). Off, a
# cache directory of another user is not used, and another user's file in yours is built
# again: loading a library runs its code. To share a cache between users on purpose, make
# it a directory of a group they share with the setgid bit (`chmod 2775 DIR`), run each
# with `umask 002` (torchweld writes files as ordinary files, under the umask), and turn
# this on.
cache_trust_other_users: bool = os.environ.get("TORCHWELD_CACHE_TRUST_OTHER_USERS", "0") == "1"

# -- weld backend ---------------------------------------------------------------
# Triton kernels whose accesses all read the flat index take their element count as an
# argument, so kernels that differ only in size compile once (compiler/codegen/triton.py,
# size_generic); 0 bakes every size into the source, as before.
size_generic_kernels: bool = os.environ.get("TORCHWELD_SIZE_GENERIC_KERNELS", "1") != "0"
# Compiled graphs kept in the disk cache (compiler/graph_cache.py): a process compiling a graph
# compiled before (by its code, its inputs' and constants' layouts, the options, the versions)
# loads its generated code and kernels instead of tracing, lowering and rendering it again.
graph_cache: bool = os.environ.get("TORCHWELD_GRAPH_CACHE", "1") != "0"
# A file to write, at exit, every compile phase of this process as a Chrome trace (one row
# per thread; open it in chrome://tracing or https://ui.perfetto.dev): which phases overlap,
# and which one the first call waits for. Empty: none.
compile_trace: str = os.environ.get("TORCHWELD_COMPILE_TRACE", "")
# The C++ compiler CPU kernels are built with (runtime/cpp_loader.py): $CXX, else g++.
cxx: str = os.environ.get("CXX", "g++")
# The C compiler the C helpers are built with (c_extension.py: the guard evaluator, the kernel
# launcher): $CC, else (empty) the first of cc, gcc, clang on PATH.
cc: str = os.environ.get("CC", "")
# Triton compile worker processes (runtime/triton_workers.py); None: one per core, up to 16.
compile_workers: int | None = _int_from_env("TORCHWELD_COMPILE_WORKERS", None)
# How much lower the compile workers' CPU priority is than this process's (os.nice; 0: the same).
# Triton's front end in 16 workers took time from the parent's threads rendering the kernels they
# wait for (densenet121's cold training step, H100 host).
worker_niceness: int = _int_from_env("TORCHWELD_WORKER_NICENESS", 10)
# Threads that load worker-compiled Triton kernels (runtime/triton_launch.py); 0: tuning.loading_threads.
loading_threads: int = _int_from_env("TORCHWELD_LOADING_THREADS", 0)
# Threads that compile Triton kernels in this process where no worker does; 0: one per core, up to 32.
compile_threads: int = _int_from_env("TORCHWELD_COMPILE_THREADS", 0)


@contextlib.contextmanager
def patch(**changes: object) -> Iterator[None]:
    """Temporarily set config values: `with config.patch(cache_size_limit=2): ...`."""
    import sys

    module = sys.modules[__name__]
    old = {}
    for name, value in changes.items():
        if not hasattr(module, name) or name.startswith("_") or name == "patch":
            raise AttributeError(f"torchweld.config has no setting {name!r}")
        old[name] = getattr(module, name)
        setattr(module, name, value)
    if "logs" in changes:
        from torchweld import logs

        logs.configure()
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)
        if "logs" in changes:
            from torchweld import logs

            logs.configure()
