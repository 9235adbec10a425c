"""Build a small C extension module with the system C compiler, once per source and
interpreter ABI, into torchweld's disk cache, and import it (the guard evaluator,
the kernel launcher).

The shared library is named by a hash of the C source, the compiler command and the
interpreter's extension suffix, so processes of other Pythons or older sources never
load it. It is a torchweld.disk_cache library: written atomically, so processes building
at once never see half a file, and its seal checked before it is imported, so a damaged
file is built again instead of crashing the import.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import shutil
import sysconfig
import threading
import types
from pathlib import Path
from typing import Callable, TypeVar

from torchweld import config
from torchweld.disk_cache import LIBRARY_FORMAT, compiler_build, content_hash, load_library, write_source

CFLAGS = ["-O2", "-shared", "-fPIC"]

# Read once, at import, not in a build thread: on Python 3.11 sysconfig fills its tables on
# first use without a lock, and a thread reading them meanwhile saw EXT_SUFFIX missing (a
# second guard evaluator built under another name in CI).
EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
_PATHS = sysconfig.get_paths()
PYTHON_INCLUDE_FOLDERS = tuple(dict.fromkeys((_PATHS["include"], _PATHS["platinclude"])))

T = TypeVar("T")


def loaded_once(loader: Callable[[], T]) -> Callable[[], T]:
    """`loader` (an extension's build-and-import) run once per process: callers in other
    threads meanwhile wait for that one run. `.start_in_background()` begins it in a daemon
    thread, so that the C compiler runs while the caller goes on tracing; a cold compile
    then does not wait for the build (the guard evaluator's takes ~0.4 s)."""
    lock = threading.Lock()
    results: list[T] = []

    @functools.wraps(loader)
    def load() -> T:
        with lock:
            if not results:
                results.append(loader())
            return results[0]

    def start_in_background() -> None:
        if not results and not lock.locked():
            threading.Thread(target=load, daemon=True, name=f"torchweld-build-{loader.__name__}").start()

    def cache_clear() -> None:  # the next call builds and imports again (tests)
        with lock:
            results.clear()

    load.start_in_background = start_in_background
    load.cache_clear = cache_clear
    return load


class ExtensionBuildError(RuntimeError):
    """Why the extension cannot be built here."""


def load_extension(source: Path, module_name: str, folder: str) -> types.ModuleType:
    """Import `source` (a C file) built as extension module `module_name` (its init function
    is named by the last part) in cache folder `folder`. Raises ExtensionBuildError, OSError
    or ImportError where it cannot be built or loaded."""
    stem = module_name.rpartition(".")[2]
    text = source.read_text()
    suffix = EXTENSION_SUFFIX
    command = [_compiler(), *CFLAGS, *(f"-I{folder}" for folder in PYTHON_INCLUDE_FOLDERS)]
    key = content_hash(text, suffix, *command, LIBRARY_FORMAT)

    def build(path: str) -> None:
        _check_toolchain(command[0])
        try:
            source_path = write_source(folder, f"{stem}_{key}.c", text)
        except OSError as e:
            raise ExtensionBuildError(f"cannot write {stem}'s source to torchweld's cache: {e}") from e
        compiler_build([*command, source_path], ExtensionBuildError)(path)

    return load_library(folder, f"{stem}_{key}{suffix}", key, build, lambda path: _import(path, module_name))


def _compiler() -> str:
    """config.cc ($CC), else the first C compiler on PATH."""
    if config.cc:
        return config.cc
    return next((cc for cc in ("cc", "gcc", "clang") if shutil.which(cc)), "cc")


def _check_toolchain(compiler: str) -> None:
    include = PYTHON_INCLUDE_FOLDERS[0]
    if shutil.which(compiler) is None:
        raise ExtensionBuildError(f"no C compiler {compiler!r} on PATH (set CC)")
    if not (Path(include) / "Python.h").exists():
        raise ExtensionBuildError(f"no Python.h in {include} (install the Python development headers)")


def _import(path: str, name: str) -> types.ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
