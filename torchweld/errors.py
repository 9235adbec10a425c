"""The exceptions a torchweld user can see, and the user-code location they name."""
from __future__ import annotations

import dataclasses
import linecache


@dataclasses.dataclass(frozen=True)
class UserLocation:
    """A line of the user's program: where a graph break or an error comes from."""

    filename: str
    lineno: int
    function: str = ""

    @property
    def source_line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"


class TorchweldError(Exception):
    """Base class of every error torchweld raises on purpose."""


class Unsupported(TorchweldError):
    """Capture cannot continue here: a graph break, or an error under fullgraph=True."""

    def __init__(self, reason: str, location: UserLocation | None = None, hint: str = ""):
        self.reason = reason
        self.location = location
        self.hint = hint
        # (instruction index, visit) of the top-level instruction that failed; set by the Translator
        self.break_point: tuple[int, int] | None = None
        super().__init__(self._message())

    def _message(self) -> str:
        if self.location is None:
            return self.reason
        text = f"{self.location}: {self.reason}"
        line = self.location.source_line
        if line:
            text += f"\n    {line}"
        if self.hint:
            text += f"\n{self.hint}"
        return text

    def at(self, location: UserLocation) -> "Unsupported":
        """This same failure, located in the user's code (kept if already located)."""
        if self.location is not None:
            return self
        return type(self)(self.reason, location, self.hint)


class BackendCompilerFailed(TorchweldError):
    """A backend raised while compiling a graph; the original error is the cause."""

    def __init__(self, backend_name: str, inner: BaseException, location: UserLocation | None = None):
        self.backend_name = backend_name
        self.inner = inner
        where = f" (graph captured from {location})" if location else ""
        super().__init__(
            f"backend {backend_name!r} raised {type(inner).__name__}: {inner}{where}\n"
            "Set torchweld.config.suppress_errors = True to run such frames eagerly instead."
        )


class InvalidArgument(TorchweldError, ValueError):
    """A bad argument to a torchweld API (an unknown mode, backend, ...)."""


class DynamicDimSpecialized(TorchweldError):
    """A dim marked dynamic (mark_dynamic) that capture had to make a number: the user's code
    needs its exact value (torch.compile's ConstraintViolationError)."""
