"""Write generated Triton source to a file cached by its hash, and import its kernels when first used.

    kernel = GeneratedKernel(module_source, "k_0123abcd")   # writes the file; imports nothing
    kernel.module_name, kernel.path, kernel.name            # what a compile worker imports instead
    kernel[(grid,)](*args, XBLOCK=...)                      # imports the module, then Triton's JIT launch

Where worker processes compile the kernels and the parent launches their binaries
(runtime/triton_launch.py), the parent never needs the JIT function: importing each
module (Triton's decorator reads and hashes the source) cost ~3.5 ms of the parent's
CPU per kernel. It is imported only for what needs it: Triton's JIT launch (a
misaligned input, Triton's interpreter), a compile in this process, or autotuning.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

from torchweld.disk_cache import cache_dir, content_hash, write_once

_import_lock = threading.Lock()


def write_module(source: str) -> tuple[str, str]:
    """(module name, file) of `source`, written once under its hash."""
    key = content_hash(source)
    return f"torchweld_triton_{key}", write_once(os.path.join(cache_dir("triton"), f"t{key}.py"), source)


def import_module(name: str, path: str):
    """The module in file `path`, imported once under `name` (Triton's jit needs a real file to read)."""
    with _import_lock:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        return module


class GeneratedKernel:
    """Triton kernel `name` of the generated module `source`, imported at first use.

    Stands in for the JIT function: `kernel[grid](...)`, and any attribute of the JIT
    function (`warmup`, `run`, ...), import the module first. `src` is the module's
    source, which identifies the kernel without importing it."""

    def __init__(self, source: str, name: str):
        self.src = source
        self.name = name
        self.module_name, self.path = write_module(source)
        self._function = None

    @property
    def jit_function(self):
        if self._function is None:
            self._function = getattr(import_module(self.module_name, self.path), self.name)
        return self._function

    def __getitem__(self, grid):
        return self.jit_function[grid]

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "_function":  # copy/pickle probes, and before __init__ ran
            raise AttributeError(attr)
        return getattr(self.jit_function, attr)

    def __repr__(self) -> str:
        return f"GeneratedKernel({self.name} in {self.path})"
