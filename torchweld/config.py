"""Every knob torchweld has, in one place; tests change them with `config.patch`.

This is the only module-level mutable state in torchweld (besides append-only
import-time registries such as the opcode table and the backend registry).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

# -- capture -----------------------------------------------------------------
cache_size_limit: int = 8  # cache entries per code object; past it the frame runs eagerly
suppress_errors: bool = False  # a backend that raises: run the frame eagerly with a warning
inline_depth_limit: int = 32  # nested inlined user calls before the frame gives up
# A bug inside capture (not a known limitation): False runs the frame eagerly with a
# warning, so the user's program goes on; True raises it (the test suite sets this).
raise_internal_errors: bool = False
# How a cache entry tests its guards before each call: "c" runs them in a small C extension
# built on first use (capture/guard_eval.c), "python" as one generated Python expression
# (also what "c" falls back to, with a log line, where no C compiler or Python.h is found).
guard_evaluator: str = os.environ.get("TORCHWELD_GUARDS", "c")

# -- logs (also set by the TORCHWELD_LOGS environment variable) ---------------
logs: str = os.environ.get("TORCHWELD_LOGS", "")  # e.g. "graph_breaks,guards,+recompiles"

# -- disk cache (torchweld/cache_root.py, torchweld/disk_cache.py) ----------------
# Where generated kernels, the libraries built from them and the guard evaluator are kept
# between processes. Empty (also TORCHWELD_CACHE_DIR="") means the default,
# ~/.cache/torchweld. Entries are written atomically and checked before use: a damaged one
# (truncated, altered, swapped, built for another CPU) is built again with one warning.
# Where the directory cannot be made or read, or belongs to another user, or a write
# there fails (read-only, deleted), this process keeps its new entries in a private
# temporary directory, removed at exit, and says so once.
cache_dir: str = os.environ.get("TORCHWELD_CACHE_DIR") or os.path.expanduser("~/.cache/torchweld")
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
# A file to write, at exit, every compile phase of this process as a Chrome trace (one row
# per thread; open it in chrome://tracing or https://ui.perfetto.dev): which phases overlap,
# and which one the first call waits for. Empty: none.
compile_trace: str = os.environ.get("TORCHWELD_COMPILE_TRACE", "")


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
