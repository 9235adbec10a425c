"""Compiled Triton kernels kept in torchweld's disk cache, so that a process that needs a
kernel compiled before (a second run of a program: a warm start) loads its binary directly,
without a compile worker or Triton's JIT.

    binary = stored(job)          # {"name", "cubin", launch metadata} or None
    store(job, binary)            # after a compile (a worker's reply, or this process's)

Triton's own cache holds the same binaries, but reaching them goes through a compile (in a
worker process or this one: importing the kernel, parsing its source, specializing, hashing)
and the workers' start: densenet121's warm start spent 0.71 s in weld's backend with them,
0.36 s loading its 30 kernels' binaries so (profiled, H200).
An entry is named by a hash of everything the binary is made from: the job's key (the
kernel's source, its pointers' dtypes and alignment, its launch config, its integers'
specialization classes), the GPU's compute capability, Triton's version and its library
file (path, size and modification time: a reinstall of the same version makes other
names), the TRITON_* settings but the cache directory's, and Triton's language and NVIDIA
knobs (floating-point fusion, ptxas and its version). Entries are sealed
(disk_cache.write_sealed): a damaged one is deleted with a warning and the kernel compiled
again.
"""
from __future__ import annotations

import base64
import functools
import json
import logging
import os

import torch

from torchweld import disk_cache

log = logging.getLogger("torchweld.cache")

KIND = "triton-binaries"
FORMAT = "triton-binary-1"


def stored(job) -> dict | None:
    """The binary of `job` (a triton_launch.CompileJob) a process stored before, or None."""
    key = _key(job)
    if key is None:
        return None
    data = disk_cache.read_sealed(KIND, f"b{key}.json", key)
    if data is None:
        return None
    try:
        binary = json.loads(data)
        binary["cubin"] = base64.b64decode(binary["cubin"])
        return binary
    except (ValueError, KeyError, TypeError):  # (sealed, so written so by a bug: compiled again)
        return None


def store(job, binary: dict) -> None:
    """Keep `binary` ({"name", "cubin" bytes, launch metadata}) as `job`'s."""
    key = _key(job)
    if key is None:
        return
    data = json.dumps({**binary, "cubin": base64.b64encode(binary["cubin"]).decode()}).encode()
    try:
        disk_cache.write_sealed(KIND, f"b{key}.json", key, data)
    except OSError as e:  # (a full or read-only cache: compiled again next time)
        log.debug("cannot keep a Triton kernel's binary: %s", e)


def _key(job) -> str | None:
    if job.device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(job.device)
    return disk_cache.content_hash(FORMAT, repr(job.key), repr(capability), _install(), _settings())


@functools.lru_cache(maxsize=None)
def _install() -> str:
    """Triton's version and its library file's identity (not its hash: 500 MB, 0.3-1 s)."""
    import triton

    try:
        from triton._C import libtriton

        stat = os.stat(libtriton.__file__)
        where = f"{libtriton.__file__}:{stat.st_size}:{stat.st_mtime_ns}"
    except (ImportError, OSError, AttributeError):
        where = "-"
    return f"{triton.__version__} {where}"


def _settings() -> str:
    """The TRITON_* variables a compile reads (the cache directory's is where, not what; a knob
    set in code writes its variable), the JIT's debug and instrumentation settings (part of a
    kernel's launch options), and the language's and NVIDIA backend's knobs as they read now
    (ptxas: its path and version)."""
    from triton import knobs

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR")
    in_code = []
    for ns in ("language", "nvidia"):
        values = getattr(getattr(knobs, ns, None), "knobs", None)
        in_code.append(sorted((k, repr(v)) for k, v in values.items()) if isinstance(values, dict) else repr(values))
    return repr((env, bool(knobs.runtime.debug), knobs.compilation.instrumentation_mode, in_code))
