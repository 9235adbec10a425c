"""The backend registry: a backend turns a captured `torch.fx.GraphModule` and
example inputs into a callable that runs it.

    @torchweld.register_backend("my_backend")
    def my_backend(gm, example_inputs):
        return gm.forward

A backend receives `gm` (whose nodes carry `meta["example_value"]`) and
`example_inputs` (the real tensors of the first call, in placeholder order), and
returns any callable taking those inputs positionally. It may also accept a
keyword `mode=` or `options=`; `lookup_backend` binds them when present.

A backend that takes `options=` may list the keys it understands as `fn.known_options`
({name: Option}): `torchweld.compile` then refuses any other key, and values of the
wrong type, naming the known ones (as torch.compile does for inductor's). Every
compiled model's backend sees a `BackendOptions`: its own copy of the user's dict, so
the user's is never written, with `shared`, where the backend keeps what all graphs of
that model share (weld's CUDA-graph pool).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import torch

from torchweld.errors import InvalidArgument

Backend = Callable[[torch.fx.GraphModule, list], Callable]

_REGISTRY: dict[str, Backend] = {}


def register_backend(name: str | Callable | None = None, *, fn: Backend | None = None):
    """Register a backend under `name`, as a decorator or directly with `fn=`."""
    if callable(name) and fn is None:  # @register_backend without a name
        return register_backend(name.__name__, fn=name)
    if fn is None:
        return lambda f: register_backend(name, fn=f)
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a backend name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not fn:
        raise InvalidArgument(f"a backend named {name!r} is already registered")
    _REGISTRY[name] = fn
    return fn


@dataclasses.dataclass(frozen=True)
class Option:
    """One key a backend's `options=` accepts: what it does, and the types (or values) it takes."""

    meaning: str
    types: tuple[type, ...] = (bool,)
    choices: tuple = ()  # where not empty, the only values accepted

    def check(self, backend: str, key: str, value: object) -> None:
        if self.choices and value not in self.choices:
            raise InvalidArgument(f"options[{key!r}] of backend {backend!r} must be one of "
                                  f"{', '.join(map(repr, self.choices))}, got {value!r}")
        if not self.choices and not isinstance(value, self.types):
            names = " or ".join(t.__name__ for t in self.types)
            raise InvalidArgument(f"options[{key!r}] of backend {backend!r} must be {names}, got "
                                  f"{type(value).__name__} {value!r}")


class BackendOptions(dict):
    """The options one compiled model's backend calls receive: a copy of the user's dict (which
    torchweld never writes), and `shared`, what those calls keep between them (not an option)."""

    def __init__(self, options: dict | None = None):
        super().__init__(options or {})
        self.shared: dict[str, object] = {}

    @classmethod
    def derived(cls, options: dict, **values) -> "BackendOptions":
        """`options` with `values` set, sharing its `shared` (a plain dict's copy gets its own)."""
        made = cls({**options, **values})
        made.shared = getattr(options, "shared", made.shared)
        return made


def check_options(backend: str | Backend, options: dict | None) -> None:
    """Raise InvalidArgument for a key `backend` does not list in its `known_options`, or a value
    of the wrong type; a backend without such a table (a user's callable) takes any key."""
    if not options:
        return
    _load_builtin_backends()
    fn = _REGISTRY.get(backend) if isinstance(backend, str) else backend
    known = getattr(fn, "known_options", None)
    if known is None:
        return
    name = backend_name(backend)
    for key, value in options.items():
        if key not in known:
            raise InvalidArgument(f"unknown option {key!r} for backend {name!r}; known options: {', '.join(sorted(known))}")
        known[key].check(name, key, value)


def registered_name(backend: str | Backend) -> str | None:
    """The name `backend` is registered under (itself, for a name), or None."""
    if isinstance(backend, str):
        return backend if backend in _REGISTRY else None
    _load_builtin_backends()
    return next((name for name, fn in _REGISTRY.items() if fn is backend), None)


def list_backends() -> list[str]:
    _load_builtin_backends()
    return sorted(_REGISTRY)


def backend_name(backend: str | Backend) -> str:
    if isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", type(backend).__name__)


def lookup_backend(backend: str | Backend, mode: str | None = None, options: dict | None = None) -> Backend:
    """The callable for `backend` (a name or a callable), with mode/options bound if it takes them:
    the options as a BackendOptions of this call's own (one per compiled model)."""
    _load_builtin_backends()
    if isinstance(backend, str):
        if backend not in _REGISTRY:
            raise InvalidArgument(
                f"unknown backend {backend!r}; registered backends: {', '.join(sorted(_REGISTRY))}"
            )
        fn = _REGISTRY[backend]
    elif callable(backend):
        fn = backend
    else:
        raise InvalidArgument(f"backend must be a name or a callable(gm, example_inputs), got {backend!r}")
    extra = {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "mode" in params:
        extra["mode"] = mode
    if "options" in params:
        extra["options"] = BackendOptions(options)
    return functools.partial(fn, **extra) if extra else fn


def backend_warm_up(backend: str | Backend) -> Callable | None:
    """The backend's `warm_up(args, kwargs)`, if it has one: capture calls it with a call's
    arguments before capturing that call's frame, so the backend can start what its compile
    will need (weld: its compile worker processes, for CUDA tensors) while capture runs."""
    _load_builtin_backends()
    fn = _REGISTRY.get(backend) if isinstance(backend, str) else backend
    return getattr(fn, "warm_up", None)


def _load_builtin_backends() -> None:
    from torchweld.backends import eager  # noqa: F401  (registers on import)

    import importlib
    import importlib.util

    for name in ("weld", "cudagraphs"):  # further built-in backends, where present
        if importlib.util.find_spec(f"torchweld.backends.{name}") is not None:
            importlib.import_module(f"torchweld.backends.{name}")
