"""`torchweld.compile` and what it returns: a CompiledFunction (a function with a
cache of guarded entries) or a CompiledModule (an nn.Module sharing the
original's parameters, buffers and submodules)."""
from __future__ import annotations

import functools
import logging
import threading
import types
import warnings
from typing import Callable

import torch

from torchweld import config, logs
from torchweld.backends import backend_name, lookup_backend
from torchweld.capture.cache import LIVE_CACHES, MISS, CacheEntry
from torchweld.capture.convert_frame import CompileSettings, translate_frame
from torchweld.capture.objects import _has_hooks
from torchweld.errors import InvalidArgument

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(model: Callable | None = None, *, fullgraph: bool = False, dynamic: bool | None = None,
            backend: str | Callable = "eager", mode: str | None = None, options: dict | None = None,
            disable: bool = False):
    """Compile a function or an nn.Module; usable as `compile(f)`, `@compile` and `@compile(...)`."""
    if mode not in MODES:
        raise InvalidArgument(f"unknown mode {mode!r}; choose one of {', '.join(repr(m) for m in MODES)}")
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument(f"options must be a dict, got {type(options).__name__}")
    settings = CompileSettings(
        backend=lookup_backend(backend, mode=mode, options=options), backend_name=backend_name(backend),
        fullgraph=fullgraph, mode=mode, options=options, dynamic=dynamic,
    )
    if model is None:
        return functools.partial(_compile_one, settings=settings, disable=disable)
    return _compile_one(model, settings=settings, disable=disable)


def _compile_one(model: Callable, settings: CompileSettings, disable: bool):
    if disable:
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


def _python_function(fn: Callable) -> tuple[types.FunctionType, object | None]:
    """The Python function to capture and the object bound as its first argument."""
    if isinstance(fn, types.MethodType):
        inner, owner = _python_function(fn.__func__)
        return inner, fn.__self__
    if isinstance(fn, types.FunctionType):
        return fn, None
    if isinstance(fn, functools.partial):
        raise InvalidArgument("torchweld.compile of a functools.partial: compile the function and call it with the arguments")
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):
        return call, fn

    def call_through(*args, **kwargs):  # a builtin such as torch.sin: capture the call to it
        return fn(*args, **kwargs)

    return call_through, None


class CompiledFunction:
    """A function with a cache of entries, each a (guards, compiled graph) pair."""

    def __init__(self, fn: Callable, settings: CompileSettings):
        self._fn, self._owner = _python_function(fn)
        functools.update_wrapper(self, fn)
        self._settings = settings
        self._entries: list[CacheEntry] = []
        self._runs: list[Callable] = []  # entry.run of each live entry, tried in order
        self._lock = threading.Lock()
        self._limit_warned = False
        LIVE_CACHES.add(self)

    def __call__(self, *args, **kwargs):
        if getattr(self._fn, "__torchweld_disabled__", False):
            return self._fn(*args, **kwargs)
        if self._owner is not None:
            args = (self._owner, *args)
        for run in self._runs:
            result = run(*args, **kwargs)
            if result is not MISS:
                return result
        return self._miss(args, kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    # -- cache ---------------------------------------------------------------
    def _miss(self, args: tuple, kwargs: dict):
        with self._lock:
            entry = next((e for e in self._entries if e.check(*args, **kwargs)), None)
            if entry is None:
                if len(self._entries) >= config.cache_size_limit:
                    self._warn_limit(args, kwargs)
                    return self._fn(*args, **kwargs)
                self._log_recompile(args, kwargs)
                entry = translate_frame(self._fn, args, kwargs, self._settings)
                self._add(entry)
        result = entry.run(*args, **kwargs)
        if result is MISS:  # the guards changed their mind (an input mutated by another thread)
            return self._fn(*args, **kwargs)
        return result

    def _add(self, entry: CacheEntry) -> None:
        def invalidate(ref=None, entry=entry) -> None:
            entry.alive = False
            with self._lock:
                self._runs = [e.run for e in self._entries if e.alive]

        entry.watchers = entry.guards.watch_identity(invalidate)
        self._entries.append(entry)
        self._runs = [e.run for e in self._entries if e.alive]

    def _log_recompile(self, args: tuple, kwargs: dict) -> None:
        log = logs.get("recompiles")
        if not self._entries or not log.isEnabledFor(logging.INFO):
            return
        reasons = [e.failing_guard(args, kwargs) or "(entry invalidated)" for e in self._entries]
        log.info("recompiling %s: %s", self._fn.__qualname__, "; ".join(f"guard failed: {r}" for r in reasons))

    def _warn_limit(self, args: tuple, kwargs: dict) -> None:
        if self._limit_warned:
            return
        self._limit_warned = True
        guard = self._entries[-1].failing_guard(args, kwargs)
        warnings.warn(
            f"torchweld: {self._fn.__qualname__} reached config.cache_size_limit={config.cache_size_limit} "
            f"compiled versions; new inputs now run eagerly. The guard that kept failing: {guard}. "
            "If this input varies on purpose (a shape, a Python number), raise cache_size_limit or make it a tensor.",
            stacklevel=3,
        )

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()
            self._runs = []
            self._limit_warned = False

    @property
    def cache_entries(self) -> list[CacheEntry]:
        return list(self._entries)


class CompiledModule(torch.nn.Module):
    """`torchweld.compile(module)`: runs `module.forward` through capture. It shares
    the original's parameters, buffers and submodules, so `state_dict()` keys,
    `.to()`, `.train()`/`.eval()` and attribute reads behave as on the original."""

    def __init__(self, module: torch.nn.Module, settings: CompileSettings):
        super().__init__()
        self.__dict__["_orig_mod"] = module  # not a registered child: keys stay unprefixed
        for shared in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[shared] = module.__dict__[shared]
        self.__dict__["training"] = module.training
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

    def train(self, mode: bool = True) -> "CompiledModule":
        self._orig_mod.train(mode)
        self.__dict__["training"] = mode
        return self

    def __repr__(self) -> str:
        return f"CompiledModule({self._orig_mod!r})"


def reset() -> None:
    """Forget every compiled version of every compiled function."""
    from torchweld.capture.translator import instructions_of

    for cache in list(LIVE_CACHES):
        cache.reset()
    instructions_of.cache_clear()
