"""The opcode table: one handler per CPython opcode, grouped by topic in the
modules of this package. `handles` registers a handler under an opcode name and
rejects duplicates and names the running CPython does not have."""
from __future__ import annotations

import dis
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

Handler = Callable[["Translator", dis.Instruction], None]
HANDLERS: dict[str, Handler] = {}

# the oldest and the newest CPython whose bytecode the handlers read
BYTECODE_VERSIONS = ((3, 11), (3, 13))


def reads_bytecode_of(version: tuple[int, int]) -> bool:
    return BYTECODE_VERSIONS[0] <= version <= BYTECODE_VERSIONS[1]


# Below a call's arguments lie the callable and a NULL (or the `self` of a method). CPython
# 3.13 pushes the callable first; 3.11 and 3.12 push the NULL (or the method) first.
CALLABLE_BELOW_NULL = sys.version_info >= (3, 13)


def handles(*names: str, since: tuple[int, int] | None = None, until: tuple[int, int] | None = None):
    """Register a handler for opcodes `names` on CPython versions in [since, until]."""

    def register(fn: Handler) -> Handler:
        version = sys.version_info[:2]
        if (since and version < since) or (until and version > until):
            return fn
        for name in names:
            if name not in dis.opmap:
                if version > BYTECODE_VERSIONS[1]:
                    continue  # a newer CPython, which torchweld.compile does not capture (api.py)
                raise ValueError(f"{name} is not an opcode of CPython {version[0]}.{version[1]}")
            if name in HANDLERS:
                raise ValueError(f"two handlers for opcode {name}")
            HANDLERS[name] = fn
        return fn

    return register


from torchweld.capture.handlers import build, calls, control, exceptions, loads, ops, stack  # noqa: E402,F401
