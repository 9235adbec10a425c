"""A compiled function: a Python function plus its cache of guarded entries.
Calling it tries each entry in order; a miss translates the frame afresh.

torchweld's stance is honoured here (torchweld.set_stance, torch_controls.stance): "force_eager" runs
the function as it is, "eager_on_recompile" runs a miss eagerly, "fail_on_recompile"
raises at a miss, "eager_then_compile" runs the first call eagerly. A copy or a pickle
holds the function and its CompileRequest, never the cache."""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
import types
import warnings
import weakref
from typing import Callable

import torch

from torchweld import config, logs, torch_controls
from torchweld.capture.cache import LIVE_CACHES, MISS, CacheEntry
from torchweld.capture.convert_frame import CompileSettings, translate_frame
from torchweld.capture.dynamic_dims import DimChoices
from torchweld.errors import InvalidArgument


def _length(obj: object) -> int | None:
    return len(obj) if isinstance(obj, list) else None


def _same_objects(entry: CacheEntry, bound: dict) -> bool:
    """Whether `entry` was compiled for the objects a call binds (`bound`), as far as the limit
    goes: the same object for each argument its guards hold by identity (a module instance: as
    torch.compile counts its versions per ID_MATCH'ed object), and for a resume function the same
    number of items left in each loop handed to it. A model's twelve blocks whose forward breaks
    the graph are twelve versions of one code object, and its loop over them resumes with twelve
    lengths: each counts apart, so that no block runs eagerly past the limit
    (config.accumulated_cache_size_limit bounds them all)."""
    identities, lengths = entry.limit_key
    return all(name not in bound or id(bound[name]) == ident for name, ident in identities) and \
        all(name not in bound or _length(bound[name]) == n for name, n in lengths)


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

    def __init__(self, fn: Callable, settings: CompileSettings, request: object | None = None,
                 loop_lists: tuple[str, ...] = ()):
        self._fn, self._owner = _python_function(fn)
        # a resume function's parameters that hold a loop's remaining items (resume.py): the
        # versions for each number of items left count apart against cache_size_limit
        self._loop_lists = loop_lists
        functools.update_wrapper(self, fn)
        self._settings = settings
        self._target = fn  # as given: what a copy compiles again
        # torchweld.compile's CompileRequest (api.py), whose settings() a copy compiles with;
        # None for the resume functions and callees capture compiles itself
        self.request = request
        self._ran_eagerly_first = False  # the first call under the "eager_then_compile" stance
        self._entries: list[CacheEntry] = []
        # every entry not yet released, which a finalizer releases once this function is dropped
        self._unreleased: list[CacheEntry] = []
        weakref.finalize(self, _release_all, self._unreleased)
        self._runs: list[Callable] = []  # entry.run of each live entry, tried in order
        self._lock = threading.RLock()  # an entry's watcher may fire while this thread holds it
        self._limit_warned = False
        self._dims = DimChoices(settings.dynamic, settings.fullgraph)  # its inputs' sizes so far, and which dims are symbolic
        # the function's defaults as the entries have them: `fn.__defaults__ = (3.0,)` between
        # calls is seen at the next call, whose arguments the entries then bind afresh
        self._defaults, self._kwdefaults = self._fn.__defaults__, self._fn.__kwdefaults__
        LIVE_CACHES.add(self)

    def __call__(self, *args, **kwargs):
        if self._owner is not None:
            args = (self._owner, *args)
        fn = self._fn
        if torch_controls.stance() == "force_eager":
            return fn(*args, **kwargs)
        if fn.__defaults__ is not self._defaults or fn.__kwdefaults__ is not self._kwdefaults:
            self._follow_defaults()
        runs = self._runs
        for run in runs:
            result = run(*args, **kwargs)
            if result is not MISS:
                return result
        return self._miss(args, kwargs, tried=runs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)

    # -- copies ----------------------------------------------------------------
    def __reduce__(self):
        """`copy.deepcopy`, pickle, `torch.save`: a module-level compiled function (a decorated
        `def`) is pickled by name, as functions are; any other is made again from its function
        and its CompileRequest, with an empty cache."""
        if getattr(sys.modules.get(self.__module__), self.__qualname__, None) is self:
            return self.__qualname__
        if self.request is None:
            raise TypeError(f"torchweld: {self._fn.__qualname__} is compiled by torchweld itself (a resume function "
                            "or a callee at a graph break) and cannot be copied or pickled; copy what the user compiled")
        return (_compiled_again, (self._target, self.request))

    # -- cache ---------------------------------------------------------------
    def _follow_defaults(self) -> None:
        with self._lock:
            self._defaults, self._kwdefaults = self._fn.__defaults__, self._fn.__kwdefaults__
            for entry in self._entries:
                entry.follow_defaults(self._fn)

    def _miss(self, args: tuple, kwargs: dict, tried: list[Callable] = ()):
        with self._lock:  # another thread may have added an entry since `tried` was read
            entry = next((e for e in self._entries if e.alive and e.run not in tried and e.check(*args, **kwargs)), None)
            if entry is None:
                try:
                    bound = inspect.signature(self._fn, follow_wrapped=False).bind(*args, **kwargs).arguments
                except TypeError:  # arguments that do not fit: the eager call raises eager's TypeError
                    return self._fn(*args, **kwargs)
                if not self._may_compile(args, kwargs, bound):
                    return self._fn(*args, **kwargs)
                self._log_recompile(args, kwargs)
                entry = translate_frame(self._fn, args, kwargs, self._settings, self._dims)
                entry.limit_key = self._limit_key(entry, bound)
                self._add(entry)
        result = entry.run(*args, **kwargs)
        if result is MISS:  # the guards changed their mind (an input mutated by another thread)
            return self._fn(*args, **kwargs)
        return result

    def _add(self, entry: CacheEntry) -> None:
        # the watchers hold this function and the entry weakly: a strong reference would make a
        # cycle that keeps the user's model (and its compiled graphs) alive until the cyclic GC runs
        function, dying = weakref.ref(self), weakref.ref(entry)

        def invalidate(ref=None) -> None:  # an object its guards hold by identity died: its id may be reused
            entry, owner = dying(), function()
            if entry is not None:
                entry.alive = False
            if owner is not None:
                owner._drop_dead_entries()

        entry.watchers = entry.guards.watch_identity(invalidate)
        self._entries.append(entry)
        self._unreleased.append(entry)
        self._runs = [e.run for e in self._entries if e.alive]

    def _drop_dead_entries(self) -> None:
        with self._lock:
            dead = [e for e in self._entries if not e.alive]
            self._entries = [e for e in self._entries if e.alive]
            self._runs = [e.run for e in self._entries]
            for entry in dead:
                if entry in self._unreleased:  # else the finalizer released it (at interpreter exit)
                    self._unreleased.remove(entry)
                    entry.release()

    def _may_compile(self, args: tuple, kwargs: dict, bound: dict) -> bool:
        """Whether a call no entry takes (its arguments `bound` by name) may be compiled; False
        runs it eagerly."""
        stance = torch_controls.stance()
        if stance == "eager_on_recompile":
            return False
        if stance == "fail_on_recompile":
            self._fail_on_recompile(args, kwargs)
        if stance in ("eager_then_compile", "aot_eager_then_compile") and not self._ran_eagerly_first:
            self._ran_eagerly_first = True
            return False
        if len(self._entries) >= config.accumulated_cache_size_limit or \
                sum(_same_objects(e, bound) for e in self._entries) >= config.cache_size_limit:
            self._warn_limit(args, kwargs)
            return False
        return True

    def _limit_key(self, entry: CacheEntry, bound: dict) -> tuple:
        """What `_same_objects` compares: (argument, id) for each argument `entry`'s guards hold by
        identity, (parameter, number of items) for each loop handed over; `bound`: the call's
        arguments by name."""
        identities = tuple((name, id(bound[name])) for name in entry.guards.identity_matched_arguments()
                           if name in bound)
        lengths = tuple((name, _length(bound[name])) for name in self._loop_lists if name in bound)
        return identities, lengths

    def _fail_on_recompile(self, args: tuple, kwargs: dict) -> None:
        code = self._fn.__code__
        message = (f"torchweld: {code.co_filename}:{code.co_firstlineno}: {self._fn.__qualname__} would be "
                   f"{'compiled again' if self._entries else 'compiled'} while torchweld.set_stance('fail_on_recompile') "
                   "is in effect")
        reasons = self._miss_reasons(args, kwargs)
        if reasons:
            message += ", because:\n" + "\n".join(f"- guard failed: {r}" for r in reasons)
        raise RuntimeError(message)

    def _miss_reasons(self, args: tuple, kwargs: dict) -> list[str]:
        return [e.failed_guard_message(args, kwargs) or "(entry invalidated)" for e in self._entries]

    def _log_recompile(self, args: tuple, kwargs: dict) -> None:
        log = logs.get("recompiles")
        if not self._entries or not log.isEnabledFor(logging.INFO):
            return
        reasons = self._miss_reasons(args, kwargs)
        log.info("recompiling %s: %s", self._fn.__qualname__, "; ".join(f"guard failed: {r}" for r in reasons))

    def _warn_limit(self, args: tuple, kwargs: dict) -> None:
        if self._limit_warned:
            return
        self._limit_warned = True
        guard = self._entries[-1].failed_guard_message(args, kwargs)
        warnings.warn(
            f"torchweld: {self._fn.__qualname__} reached config.cache_size_limit={config.cache_size_limit} "
            f"compiled versions; new inputs now run eagerly. The guard that kept failing: {guard}. "
            "If this input varies on purpose (a shape, a Python number), raise cache_size_limit or make it a tensor.",
            stacklevel=_user_stacklevel(),
        )

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()
            self._runs = []
            self._limit_warned = False
            _release_all(self._unreleased)

    @property
    def cache_entries(self) -> list[CacheEntry]:
        return list(self._entries)


_TORCHWELD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODULE_CALL_FILE = torch.nn.modules.module.__file__  # nn.Module.__call__ of a CompiledModule


def _user_stacklevel() -> int:
    """The `stacklevel` of a warning raised by its caller that names the user's line: the first
    frame outside torchweld and nn.Module's call machinery."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCHWELD_DIR)
                                 or frame.f_code.co_filename == _MODULE_CALL_FILE):
        frame, level = frame.f_back, level + 1
    return level


def _compiled_again(fn: Callable, request) -> CompiledFunction:
    """A copy's or a loaded pickle's compiled function: `fn` compiled as `request` asks, nothing cached."""
    return CompiledFunction(fn, request.settings(), request)


def _release_all(entries: list[CacheEntry]) -> None:
    for entry in entries:
        entry.release()
    entries.clear()
