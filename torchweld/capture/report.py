"""What each translation did, for `explain()` and the logs: graphs, guards,
compile times and the reasons capture stopped."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import torch

from torchweld.capture.break_kinds import BreakKind, kind_of
from torchweld.errors import UserLocation


@dataclasses.dataclass
class BreakReason:
    reason: str
    location: UserLocation | None
    count: int = 1

    @property
    def source_line(self) -> str:
        return self.location.source_line if self.location else ""

    @property
    def kind(self) -> BreakKind:
        """What sort of break it is (capture/break_kinds.py), for grouping and counting."""
        return kind_of(self.reason)

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        line = f"\n    {self.source_line}" if self.source_line else ""
        times = f" ({self.count} times)" if self.count > 1 else ""
        return f"{where}{self.reason}{times}{line}"


@dataclasses.dataclass
class TranslationReport:
    """One translation of one code object (one cache entry)."""

    function: str
    graph: torch.fx.GraphModule | None
    op_count: int
    guards: list[str]
    compile_time_s: float
    break_reason: BreakReason | None = None


_active: contextvars.ContextVar[list[TranslationReport] | None] = contextvars.ContextVar("torchweld_reports", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[TranslationReport]]:
    """Collect the reports of every translation made inside the block."""
    reports: list[TranslationReport] = []
    token = _active.set(reports)
    try:
        yield reports
    finally:
        _active.reset(token)


def publish(report: TranslationReport) -> None:
    reports = _active.get()
    if reports is not None:
        reports.append(report)


def note_break_hit(reason: BreakReason) -> None:
    """A frame that runs eagerly for `reason` ran once more."""
    reason.count += 1
