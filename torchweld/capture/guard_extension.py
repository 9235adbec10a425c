"""Build the C guard evaluator (guard_eval.c) with the system C compiler, once per
source and interpreter ABI, into torchweld's disk cache, and import it.

The shared library is named by a hash of the C source, the compiler command and the
interpreter's extension suffix, so processes of other Pythons or older sources never
load it; it is built with torchweld.disk_cache.compile_once, so processes building at once
never see half a file. Where it cannot be built (no compiler, no
Python.h), `load()` says why once in the `guards` log and returns None: the guards
then run as their Python expression.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import shutil
import sysconfig
import types
from pathlib import Path

from torchweld import logs
from torchweld.disk_cache import cache_dir, compile_once, content_hash, write_once

SOURCE = Path(__file__).with_name("guard_eval.c")
CFLAGS = ["-O2", "-shared", "-fPIC"]


class GuardExtensionError(RuntimeError):
    """Why the extension cannot be built here."""


@functools.lru_cache(maxsize=None)
def load() -> types.ModuleType | None:
    """The `guard_eval` extension module, or None (logged once) where it cannot be built."""
    try:
        return _import(_build())
    except (GuardExtensionError, OSError, ImportError) as e:
        logs.get("guards").warning("torchweld: guards run as Python expressions; the C guard evaluator "
                                   "is unavailable: %s", e)
        return None


def _compiler() -> str:
    """$CC, else the first C compiler on PATH."""
    if "CC" in os.environ:
        return os.environ["CC"]
    return next((cc for cc in ("cc", "gcc", "clang") if shutil.which(cc)), "cc")


def _include_flags() -> list[str]:
    """Where Python.h and pyconfig.h are (one folder, or two on multiarch layouts)."""
    paths = sysconfig.get_paths()
    return [f"-I{folder}" for folder in dict.fromkeys((paths["include"], paths["platinclude"]))]


def _build() -> str:
    """The path of the built extension, compiling it if no process has yet."""
    source = SOURCE.read_text()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths()["include"]
    command = [_compiler(), *CFLAGS, *_include_flags()]
    key = content_hash(source, suffix, *command)
    directory = cache_dir("guards")
    target = os.path.join(directory, f"guard_eval_{key}{suffix}")
    if os.path.exists(target):
        return target
    if shutil.which(command[0]) is None:
        raise GuardExtensionError(f"no C compiler {command[0]!r} on PATH (set CC)")
    if not (Path(include) / "Python.h").exists():
        raise GuardExtensionError(f"no Python.h in {include} (install the Python development headers)")
    source_path = write_once(os.path.join(directory, f"guard_eval_{key}.c"), source)
    return compile_once([*command, source_path], target, GuardExtensionError)


def _import(path: str) -> types.ModuleType:
    name = "torchweld.capture.guard_eval"  # its init function is named by the last part
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
