"""The C guard evaluator (guard_eval.c), built on first use into torchweld's disk cache
(torchweld/c_extension.py). Where it cannot be built (no compiler, no Python.h),
`load()` says why once in the `guards` log and returns None: the guards then run as
their Python expression. Capture starts the build in the background when it begins
translating a frame (`load.start_in_background()`), so it overlaps the tracing.
"""
from __future__ import annotations

import types
from pathlib import Path

from torchweld import logs
from torchweld.c_extension import ExtensionBuildError, load_extension, loaded_once

SOURCE = Path(__file__).with_name("guard_eval.c")


@loaded_once
def load() -> types.ModuleType | None:
    """The `guard_eval` extension module, or None (logged once) where it cannot be built."""
    try:
        return load_extension(SOURCE, "torchweld.capture.guard_eval", "guards")
    except (ExtensionBuildError, OSError, ImportError) as e:
        logs.get("guards").warning("torchweld: guards run as Python expressions; the C guard evaluator "
                                   "is unavailable: %s", e)
        return None
