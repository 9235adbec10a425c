"""`torchweld.compile` and what it returns: a CompiledFunction (a function with a
cache of guarded entries) or a CompiledModule (an nn.Module sharing the
original's parameters, buffers and submodules).

Both can be copied (`copy.deepcopy`) and pickled (`torch.save` of a whole model): a copy
holds the original module (copied with it) or function and the CompileRequest it was
compiled with, and no compiled code: it compiles again, lazily, at its first call."""
from __future__ import annotations

import dataclasses
import functools
import pickle
import sys
import types
import warnings
from typing import Callable

import torch

from torchweld.backends import backend_name, backend_warm_up, check_options, lookup_backend, registered_name
from torchweld.capture import handlers
from torchweld.capture.builder import marked_disabled
from torchweld.capture.cache import LIVE_CACHES
from torchweld.capture.compiled_function import CompiledFunction
from torchweld.capture.convert_frame import CompileSettings
from torchweld.capture.ddp import DDPForward, is_ddp
from torchweld.capture.native_hooks import call_with_native_hooks, hooks_run_natively
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
    check_options(backend, options)
    request = CompileRequest(backend, fullgraph=fullgraph, dynamic=dynamic, mode=mode,
                             options=None if options is None else dict(options))
    if model is None:
        return functools.partial(_compile_one, request=request, disable=disable)
    return _compile_one(model, request=request, disable=disable)


@dataclasses.dataclass(frozen=True, eq=False)
class CompileRequest:
    """What `torchweld.compile` was asked (its own copy of the options): enough to compile the
    same function again in a copy of a compiled model, or after it is loaded."""

    backend: str | Callable
    fullgraph: bool = False
    dynamic: bool | None = None
    mode: str | None = None
    options: dict | None = None

    def settings(self) -> CompileSettings:
        """Fresh settings: each compiled function made from them has caches of its own."""
        backend = self.backend
        return CompileSettings(
            backend=lookup_backend(backend, mode=self.mode, options=self.options), backend_name=backend_name(backend),
            fullgraph=self.fullgraph, mode=self.mode, options=self.options, dynamic=self.dynamic,
            warm_up=backend_warm_up(backend),
        )

    def __deepcopy__(self, memo: dict) -> "CompileRequest":
        """The same backend (a compiler, not state), the options in a dict of the copy's own."""
        return dataclasses.replace(self, options=None if self.options is None else dict(self.options))

    def __reduce__(self):
        """Pickled with the backend by its registered name where it has one; a backend callable
        that cannot be pickled is named in the error."""
        backend = registered_name(self.backend) or self.backend
        if not isinstance(backend, str):
            try:
                pickle.dumps(backend)
            except Exception as e:
                raise pickle.PicklingError(
                    f"torchweld: cannot pickle the backend {backend_name(backend)!r} this model was compiled with "
                    f"({type(e).__name__}: {e}). Define the backend at the top level of a module, or register it "
                    "with torchweld.register_backend('name') and compile with backend='name'."
                ) from None
        return (CompileRequest, (backend, self.fullgraph, self.dynamic, self.mode, self.options))


def _compile_one(model: Callable, request: CompileRequest, disable: bool):
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
        return CompiledModule(model, request)
    if not callable(model):
        raise InvalidArgument(
            f"torchweld.compile expects a function or an nn.Module, got {type(model).__name__} object {model!r}"
        )
    return CompiledFunction(model, request.settings(), request)


def disable(fn: Callable) -> Callable:
    """Mark `fn` so that capture never looks inside it: it always runs natively."""

    @functools.wraps(fn)
    def disabled(*args, **kwargs):
        return fn(*args, **kwargs)

    disabled.__torchweld_disabled__ = True
    return disabled


# the hooks of one module call (nn.Module.__init__ makes each dict), shared with the original
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class CompiledModule(torch.nn.Module):
    """`torchweld.compile(module)`: runs `module.forward` through capture. It shares
    the original's parameters, buffers and submodules, so `state_dict()` keys,
    `.to()`, `.train()`/`.eval()` and attribute reads behave as on the original. It shares its
    hooks too, and a call is its forward alone: a hook registered on either runs once, around
    the compiled forward, as do global module hooks (nn.Module's call would run them a second
    time around the wrapper, as it does for torch.compile's wrapper)."""

    def __init__(self, module: torch.nn.Module, request: CompileRequest):
        super().__init__()
        self.__dict__["_orig_mod"] = module  # not a registered child: keys stay unprefixed
        for shared in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_DICTS):
            self.__dict__[shared] = module.__dict__[shared]
        if is_ddp(module):  # DDP's bookkeeping in Python each call, its module captured (capture/ddp.py)
            self.__dict__["_compiled_forward"] = types.MethodType(DDPForward(request.settings(), request), module)
        else:
            forward = type(module).forward.__get__(module)
            self.__dict__["_compiled_forward"] = CompiledFunction(forward, request.settings(), request)

    def __reduce__(self):
        """A copy (`copy.deepcopy`, pickle, `torch.save`) holds a copy of the original module and
        the compile request; nothing compiled: the copy compiles at its first call."""
        return (CompiledModule, (self._orig_mod, self._compiled_forward.request))

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        module = self._orig_mod
        if _has_hooks(module):  # forward (pre-)hooks (FSDP2's, the user's) run in Python around the compiled forward
            if hooks_run_natively(module):
                return call_with_native_hooks(module, self._compiled_forward, args, kwargs)
            return module(*args, **kwargs)
        return self._compiled_forward(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_orig_mod"], name)

    @property
    def _is_full_backward_hook(self):  # set by register_(full_)backward_hook: the hooks' kind, the original's
        return self._orig_mod._is_full_backward_hook

    @_is_full_backward_hook.setter
    def _is_full_backward_hook(self, value) -> None:
        if "_orig_mod" in self.__dict__:  # (nn.Module.__init__ sets it before there is an original)
            self._orig_mod._is_full_backward_hook = value

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
    """Forget every compiled version of every compiled function, and what capture remembered
    about code and operators (resume code, decoded instructions, fake-run results, dtype checks).
    Loaded kernels, the C helpers and the compile workers stay: they depend on nothing reset."""
    from torchweld import fake_memo
    from torchweld.capture import dtype_refusals, rank_compiles, resume
    from torchweld.capture.translator import instructions_of

    for cache in list(LIVE_CACHES):
        cache.reset()
    instructions_of.cache_clear()
    resume.forget()
    dtype_refusals.forget()
    rank_compiles.forget()
    fake_memo.forget()
