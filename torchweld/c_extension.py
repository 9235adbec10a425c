"""Build a small C extension module with the system C compiler, once per source and
interpreter ABI, into torchweld's disk cache, and import it (the guard evaluator,
the kernel launcher).

The shared library is named by a hash of the C source, the compiler command and the
interpreter's extension suffix, so processes of other Pythons or older sources never
load it; it is built with torchweld.disk_cache.compile_once, so processes building at
once never see half a file.
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

from torchweld.disk_cache import cache_dir, compile_once, content_hash, write_once

CFLAGS = ["-O2", "-shared", "-fPIC"]

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
    return _import(_build(source, module_name.rpartition(".")[2], folder), module_name)


def _compiler() -> str:
    """$CC, else the first C compiler on PATH."""
    if "CC" in os.environ:
        return os.environ["CC"]
    return next((cc for cc in ("cc", "gcc", "clang") if shutil.which(cc)), "cc")


def _include_flags() -> list[str]:
    """Where Python.h and pyconfig.h are (one folder, or two on multiarch layouts)."""
    paths = sysconfig.get_paths()
    return [f"-I{folder}" for folder in dict.fromkeys((paths["include"], paths["platinclude"]))]


def _build(source_file: Path, stem: str, folder: str) -> str:
    """The path of the built extension, compiling it if no process has yet."""
    source = source_file.read_text()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths()["include"]
    command = [_compiler(), *CFLAGS, *_include_flags()]
    key = content_hash(source, suffix, *command)
    directory = cache_dir(folder)
    target = os.path.join(directory, f"{stem}_{key}{suffix}")
    if os.path.exists(target):
        return target
    if shutil.which(command[0]) is None:
        raise ExtensionBuildError(f"no C compiler {command[0]!r} on PATH (set CC)")
    if not (Path(include) / "Python.h").exists():
        raise ExtensionBuildError(f"no Python.h in {include} (install the Python development headers)")
    source_path = write_once(os.path.join(directory, f"{stem}_{key}.c"), source)
    return compile_once([*command, source_path], target, ExtensionBuildError)


def _import(path: str, name: str) -> types.ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
