"""Generator functions called in captured code: the generator is its body's Translator,
run one step (up to the next `yield`) each time its consumer pulls an item — a `for` loop,
`next()`, `list()`, `zip()` — so that what the body does is recorded in the order eager
does it, interleaved with the consumer's work. `contextlib.contextmanager` functions work
through this: `__enter__` pulls the first item, `__exit__` the end. A generator that leaves
the frame (returned, alive at a graph break) cannot be rebuilt: capture breaks there."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchweld.capture.values import LazyIteratorValue, Value
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

# steps one generator may take: more is taken for a generator that never ends
MAX_STEPS = 10_000


class GeneratorValue(LazyIteratorValue):
    """A generator made in the frame: pulling an item runs its body to the next `yield`."""

    def __init__(self, body: "Translator"):
        body.is_generator = True
        self.body = body
        self.finished = False
        self.steps = 0
        super().__init__(self._step)

    def python_type(self) -> type:
        return type(x for x in ())

    def _step(self) -> Value | None:
        if self.finished:
            return None
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise Unsupported(f"a generator ({self.body.code.co_qualname}) yielding more than {MAX_STEPS} items")
        body = self.body
        body.paused_at = None
        body.run()  # to the next yield (paused_at) or to its return
        if body.paused_at is None:
            self.finished = True
            return None
        return body.paused_at

    def getattr(self, tx, name):
        if name == "close" and self.finished:
            from torchweld.capture.values import ConstantValue

            return _Done(ConstantValue(None))
        raise Unsupported(f"generator.{name}() is not modelled (send, throw and close of a running generator)")

    def __repr__(self) -> str:
        return f"GeneratorValue({self.body.code.co_qualname})"


class _Done(Value):
    """`gen.close()` of a generator that already returned: nothing to do."""

    def __init__(self, result: Value):
        self.result = result

    def call(self, tx, args, kwargs):
        return self.result
