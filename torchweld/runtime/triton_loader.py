"""Write generated Triton source to a file cached by its hash and import its kernels."""
from __future__ import annotations

import importlib.util
import os
import sys

from torchweld.disk_cache import cache_dir, content_hash, write_once


def load_module(source: str) -> tuple[object, str]:
    """The imported module of `source` (Triton's jit needs a real file to read) and its path."""
    key = content_hash(source)
    path = write_once(os.path.join(cache_dir("triton"), f"t{key}.py"), source)
    name = f"torchweld_triton_{key}"
    if name in sys.modules:
        return sys.modules[name], path
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module, path
