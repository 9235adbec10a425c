"""`os.environ` read inside a captured frame (`os.environ.get("FLAG", "0") == "1"`, as
transformers' attention does): each read is a constant of the graph, guarded on that
variable's value, so setting or changing it recompiles. Writes run in Python."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchweld.capture.sources import EnvironSource, Source
from torchweld.capture.values import ConstantValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


class EnvironValue(Value):
    def __init__(self, source: Source | None):
        self.source = source

    def python_type(self) -> type:
        return type(os.environ)

    def real_object(self) -> object:
        return os.environ

    def read(self, tx: "Translator", key: Value) -> str | None:
        name = key.as_constant()
        if not isinstance(name, str):
            raise Unsupported(f"os.environ[{name!r}]: keys are str")
        value = os.environ.get(name)
        tx.output.guards.constant(EnvironSource(name), value)
        return value

    def getitem(self, tx: "Translator", key: Value) -> Value:
        value = self.read(tx, key)
        if value is None:
            from torchweld.capture.exceptions import CapturedRaise

            raise CapturedRaise.of(KeyError, key.as_constant())
        return ConstantValue(value)

    def contains(self, tx: "Translator", key: Value) -> bool:
        return self.read(tx, key) is not None

    def getattr(self, tx: "Translator", name: str) -> Value:
        if name == "get":
            return _EnvironGet(self)
        raise Unsupported(f"os.environ.{name} is not captured (only reads: get, [], in)")


class _EnvironGet(Value):
    def __init__(self, environ: EnvironValue):
        self.environ = environ

    def call(self, tx, args, kwargs):
        if kwargs or not 1 <= len(args) <= 2:
            raise Unsupported("os.environ.get takes a key and a default")
        value = self.environ.read(tx, args[0])
        if value is None:
            return args[1] if len(args) == 2 else ConstantValue(None)
        return ConstantValue(value)
