"""`torchweld.compile` and what it returns: a CompiledFunction (a function with a
cache of guarded entries) or a CompiledModule (an nn.Module sharing the
original's parameters, buffers and submodules)."""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Callable

import torch

from torchweld.backends import backend_name, backend_warm_up, lookup_backend
from torchweld.capture import handlers
from torchweld.capture.builder import marked_disabled
from torchweld.capture.cache import LIVE_CACHES
from torchweld.capture.compiled_function import CompiledFunction
from torchweld.capture.convert_frame import CompileSettings
from torchweld.capture.objects import _has_hooks
from torchweld.errors import InvalidArgument

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(model: Callable | None = None, *, fullgraph: bool = False, dynamic: bool | None = None,
            backend: str | Callable = "weld", mode: str | None = None, options: dict | None = None,
            disable: bool = False):
    """Compile a function or an nn.Module; usable as `compile(f)`, `@compile` and `@compile(...)`."""
    if mode not in MODES:
        raise InvalidArgument(f"unknown mode {mode!r}; choose one of {', '.join(repr(m) for m in MODES)}")
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument(f"options must be a dict, got {type(options).__name__}")
    settings = CompileSettings(
        backend=lookup_backend(backend, mode=mode, options=options), backend_name=backend_name(backend),
        fullgraph=fullgraph, mode=mode, options=options, dynamic=dynamic, warm_up=backend_warm_up(backend),
    )
    if model is None:
        return functools.partial(_compile_one, settings=settings, disable=disable)
    return _compile_one(model, settings=settings, disable=disable)


def _compile_one(model: Callable, settings: CompileSettings, disable: bool):
    if disable or marked_disabled(model):  # decided once, not per call
        return model
    if not handlers.reads_bytecode_of(sys.version_info[:2]):
        oldest, newest = handlers.BYTECODE_VERSIONS
        warnings.warn(
            f"torchweld captures the bytecode of CPython {oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}; "
            f"this is CPython {sys.version_info[0]}.{sys.version_info[1]}, so {getattr(model, '__name__', model)!r} "
            "runs as it is, not compiled", RuntimeWarning, stacklevel=3)
        return model
    if isinstance(model, torch.nn.Module):
        return CompiledModule(model, settings)
    if not callable(model):
        raise InvalidArgument(
            f"torchweld.compile expects a function or an nn.Module, got {type(model).__name__} object {model!r}"
        )
    return CompiledFunction(model, settings)


def disable(fn: Callable) -> Callable:
    """Mark `fn` so that capture never looks inside it: it always runs natively."""

    @functools.wraps(fn)
    def disabled(*args, **kwargs):
        return fn(*args, **kwargs)

    disabled.__torchweld_disabled__ = True
    return disabled


class CompiledModule(torch.nn.Module):
    """`torchweld.compile(module)`: runs `module.forward` through capture. It shares
    the original's parameters, buffers and submodules, so `state_dict()` keys,
    `.to()`, `.train()`/`.eval()` and attribute reads behave as on the original."""

    def __init__(self, module: torch.nn.Module, settings: CompileSettings):
        super().__init__()
        self.__dict__["_orig_mod"] = module  # not a registered child: keys stay unprefixed
        for shared in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[shared] = module.__dict__[shared]
        self.__dict__["_compiled_forward"] = CompiledFunction(type(module).forward.__get__(module), settings)

    def forward(self, *args, **kwargs):
        module = self._orig_mod
        if _has_hooks(module):
            return module(*args, **kwargs)
        return self._compiled_forward(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_orig_mod"], name)

    @property
    def training(self) -> bool:  # the original's, which `model.eval()` on it changes too
        return self._orig_mod.training

    @training.setter
    def training(self, mode: bool) -> None:
        if "_orig_mod" in self.__dict__:  # nn.Module.__init__ sets it first: the original's mode stands
            self._orig_mod.training = mode

    def train(self, mode: bool = True) -> "CompiledModule":
        self._orig_mod.train(mode)
        return self

    def __repr__(self) -> str:
        return f"CompiledModule({self._orig_mod!r})"


def reset() -> None:
    """Forget every compiled version of every compiled function."""
    from torchweld.capture.translator import instructions_of

    for cache in list(LIVE_CACHES):
        cache.reset()
    instructions_of.cache_clear()
