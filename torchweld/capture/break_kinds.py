"""The kind of a graph break, so that `explain()` and the logs can group and count them.

Each break's reason is a sentence written where capture stopped (about 190 places); its kind
is read from that sentence here, in one table, rather than passed from every place. The first
kind whose words the reason holds wins, so the table goes from the most specific to the most
general. A reason no rule matches is UNMODELLED: something capture does not model yet.
"""
from __future__ import annotations

import enum


class BreakKind(enum.Enum):
    """Why capture stopped, in words a user acts on (the value is the hint `explain()` prints)."""

    DATA_DEPENDENT = "data-dependent: Python needs a tensor's value (an `if` on it, .item(), .tolist(), numpy)"
    PYTHON = "Python must run here (print, I/O, a function torch marks to run without compilers, a generator)"
    USER_ERROR = "the eager run raises here: the error is raised at your line, as eager raises it"
    SIDE_EFFECT = "a change to Python state outside the frame that capture does not replay"
    DISTRIBUTED = "communication between processes (collectives, DDP's and FSDP's bookkeeping) runs in Python around the graph"
    BACKEND = "the backend failed; the graph runs eagerly"
    INTERNAL = "an internal error in torchweld; the frame runs eagerly (please report it)"
    UNMODELLED = "a Python feature or object capture does not model yet"


# (kind, words any of which marks it), most specific first
_RULES: tuple[tuple[BreakKind, tuple[str, ...]], ...] = (
    (BreakKind.INTERNAL, ("internal error",)),
    (BreakKind.BACKEND, ("backend ",)),
    (BreakKind.DISTRIBUTED, ("DistributedDataParallel", "FSDP", "communicates with other processes")),
    (BreakKind.DATA_DEPENDENT, ("data-dependent", "needs its value", "needs their values", "needs its values",
                                "needs them", "into a string needs", "reads its value", "compares tensor values",
                                "compares their values", "only known at run time")),
    (BreakKind.SIDE_EFFECT, ("side effect", "changes Python state", "outside the frame", "defines __setattr__",
                             "setting it needs Python", "registered state")),
    (BreakKind.UNMODELLED, ("capture models", "not modelled", "does not model", "not supported", "not captured yet")),
    (BreakKind.USER_ERROR, ("the eager run raises", "the eager call raises", "raises ", " raised ",
                            "referenced before assignment", "is not defined", "not a dict", "not callable",
                            "not iterable", "not subscriptable", "has no attribute")),
    (BreakKind.PYTHON, ("needs Python", "runs natively", "without compilers", "runs eagerly", "runs its module's code",
                        "a coroutine", "eager's checkpoint", "called in Python", "is not folded")),
)


def kind_of(reason: str) -> BreakKind:
    """The kind of a break whose reason is `reason`."""
    for kind, words in _RULES:
        if any(word in reason for word in words):
            return kind
    return BreakKind.UNMODELLED
