"""Calls that change or ask a mode capture models instead of recording: grad mode
(grad_mode.py), autocast (autocast.py) and profiler ranges (profiler_ranges.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchweld.capture.autocast import autocast_call
from torchweld.capture.grad_mode import grad_mode_call
from torchweld.capture.profiler_ranges import profiler_range_call
from torchweld.capture.values import Value

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


def mode_call(tx: "Translator", fn: object, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
    """The value of calling `fn` if it is a grad-mode or autocast function or class, else None."""
    special = grad_mode_call(tx, fn, args, kwargs)
    if special is None:
        special = autocast_call(tx, fn, args, kwargs)
    return special if special is not None else profiler_range_call(fn)
