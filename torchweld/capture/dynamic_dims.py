"""Which dims of a compiled function's tensor inputs are symbolic, as torch.compile decides:

- `dynamic=False`: none but those marked with `mark_dynamic` (torchweld's or torch's);
- `dynamic=True`: every dim of every input tensor (read from an argument or a global, also
  through items and attributes; not a module's parameters and buffers), from the first call;
- `dynamic=None` (the default): a dim becomes symbolic once a call brings a size different
  from the one the first capture saw ("automatic dynamic"), and stays symbolic for that
  function; the first capture is specialized.

An int argument of the function (a size or count passed in, or one a graph break hands a
resume function) is read as a symbol the same way: under `dynamic=True` from the first call,
under `dynamic=None` once a call brings another value (torch.compile's unspecialized ints:
of any sign, 0 and 1 included). A float argument likewise becomes a graph input, a 0-d tensor
that a float32 or float64 tensor's + - * reads (operators.py), guarded on its type only until
Python itself computes with its value (torch.compile's unspecialized floats).

`mark_static` keeps a dim a number in every mode. One `DimChoices` belongs to one compiled
function (a resume function or a callee compiled at a break has its own), which keeps it
across its captures. Marks are attributes set on the tensor, read here:
torchweld's own and the ones torch's mark_dynamic, maybe_mark_dynamic and mark_static
set (`_dynamo_dynamic_indices`, `_dynamo_weak_dynamic_indices`, `_dynamo_static_indices`;
read, never imported)."""
from __future__ import annotations

import logging

import torch

from torchweld import logs
from torchweld.capture.sources import AttrSource, GlobalSource, ItemSource, LocalSource, ModuleEntrySource, Source

# (why, exact, min, max): `exact` asks for a symbol of its own (a mark), else sizes equal at
# capture share one symbol, as torch.compile's duck sizing does
DimChoice = tuple[str, bool, "int | None", "int | None"]

DYNAMIC_MARK = "_dynamo_dynamic_indices"          # torch's mark_dynamic and torchweld.mark_dynamic
WEAK_DYNAMIC_MARK = "_dynamo_weak_dynamic_indices"  # torch's maybe_mark_dynamic
STATIC_MARK = "_dynamo_static_indices"            # torch's mark_static and torchweld.mark_static
RANGE_MARK = "_torchweld_dynamic_ranges"          # torchweld.mark_dynamic's min/max: {dim: (min, max)}


def _checked_dims(t: torch.Tensor, dim, what: str) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torchweld.{what} takes a tensor, not a {type(t).__name__}")
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    checked = []
    for d in dims:
        if type(d) is not int:
            raise TypeError(f"torchweld.{what}: dim must be an int, not {type(d).__name__}")
        if d < 0 or d >= t.dim():
            raise ValueError(f"torchweld.{what}: dim {d} is out of range for a tensor of {t.dim()} dims "
                             f"(0 to {t.dim() - 1}; negative dims are not accepted)")
        checked.append(d)
    return checked


def mark_dynamic(t: torch.Tensor, dim: int | list[int], min: int | None = None, max: int | None = None) -> None:
    """Make dim `dim` of `t` symbolic wherever `t` enters a compiled function, within [min, max].
    A capture that must specialize it (the code branches on its exact value) raises an error
    naming the line. A size outside [min, max] compiles a version with that dim a number."""
    dims = _checked_dims(t, dim, "mark_dynamic")
    if min is not None and max is not None and min > max:
        raise ValueError(f"torchweld.mark_dynamic: min={min} is above max={max}")
    if not hasattr(t, DYNAMIC_MARK):
        setattr(t, DYNAMIC_MARK, set())
    getattr(t, DYNAMIC_MARK).update(dims)
    if min is not None or max is not None:
        if not hasattr(t, RANGE_MARK):
            setattr(t, RANGE_MARK, {})
        for d in dims:
            getattr(t, RANGE_MARK)[d] = (min, max)


def mark_static(t: torch.Tensor, dim: int | list[int]) -> None:
    """Keep dim `dim` of `t` a number (specialized) in every mode."""
    dims = _checked_dims(t, dim, "mark_static")
    if not hasattr(t, STATIC_MARK):
        setattr(t, STATIC_MARK, set())
    getattr(t, STATIC_MARK).update(dims)


def marked(t: torch.Tensor, attribute: str) -> set[int]:
    found = getattr(t, attribute, None)
    return set(found) if found else set()


def _root(source: Source) -> Source:
    """The source an attribute or item chain starts from."""
    while isinstance(source, (ItemSource, AttrSource)):
        source = source.base
    return source


def may_be_dynamic(source: Source, real: torch.Tensor) -> bool:
    """Read from an argument or a global, through items and attributes (a KV cache object's
    tensors, a module's plain tensor attribute); not a module's parameter or buffer, which stay
    static, as torch.compile's force_parameter_static_shapes keeps them."""
    if isinstance(real, (torch.nn.Parameter, torch.nn.parameter.Buffer)):
        return False
    while isinstance(source, (ItemSource, AttrSource)):
        if isinstance(source, ModuleEntrySource) and source.store in ("_parameters", "_buffers"):
            return False
        source = source.base
    return isinstance(source, (LocalSource, GlobalSource))


class DimChoices:
    """One compiled function's record of the sizes its inputs came with, and its choice of
    symbolic dims for the next capture."""

    def __init__(self, dynamic: bool | None, fullgraph: bool = False):
        self.dynamic = dynamic
        self.fullgraph = fullgraph  # a size outside a mark_dynamic range is then an error, not a new version
        self.first_sizes: dict[str, tuple[int, ...]] = {}  # source name -> sizes at the first capture
        self.automatic: dict[str, dict[int, str]] = {}  # source name -> {dim: why it became symbolic}
        self.first_ints: dict[str, int] = {}  # int argument's source name -> its value at the first capture
        self.symbolic_ints: set[str] = set()  # int arguments made symbols (under dynamic=None)
        self.first_floats: dict[str, float] = {}  # float argument's source name -> its value at the first capture
        self.input_floats: set[str] = set()  # float arguments read as graph inputs (under dynamic=None)

    def choose(self, source: Source, real: torch.Tensor) -> dict[int, DimChoice]:
        """The dims of `real` (read from `source`) to make symbolic in this capture."""
        name = source.name()
        marks = marked(real, DYNAMIC_MARK)
        if not may_be_dynamic(source, real) and not marks:
            return {}
        static = marked(real, STATIC_MARK)
        ranges = getattr(real, RANGE_MARK, None) or {}
        chosen: dict[int, DimChoice] = {}
        for d in sorted(marks - static):
            if d >= real.dim():
                continue
            low, high = ranges.get(d, (None, None))
            n = real.shape[d]
            if (low is not None and n < low) or (high is not None and n > high):
                if self.fullgraph:
                    from torchweld.errors import DynamicDimSpecialized

                    raise DynamicDimSpecialized(
                        f"{name}.size()[{d}] is {n}, outside the range [{low}, {high}] mark_dynamic gave it; with "
                        "fullgraph=True that is an error (without it, this call compiles a version where the dim "
                        "is a number). Widen the range, or drop fullgraph=True")
                logs.get("dynamic").info("%s: dim %d has size %d, outside the range [%s, %s] mark_dynamic gave: "
                                         "this version specializes it", name, d, n, low, high)
                continue
            chosen[d] = ("marked with mark_dynamic", True, low, high)
        for d in sorted(marked(real, WEAK_DYNAMIC_MARK) - static):
            if d < real.dim():
                chosen.setdefault(d, ("marked with maybe_mark_dynamic", False, None, None))
        if self.dynamic is True:
            for d in range(real.dim()):
                if d not in static:
                    chosen.setdefault(d, ("dynamic=True", False, None, None))
        elif self.dynamic is None:
            self._notice_changes(name, real)
            for d, why in self.automatic.get(name, {}).items():
                if d not in static and d < real.dim():
                    chosen.setdefault(d, (why, False, None, None))
        return chosen

    def int_is_symbolic(self, source: Source, value: int) -> bool:
        """Whether the int argument `value` read from `source` is a symbol in this capture."""
        return isinstance(source, LocalSource) and \
            self._number_varies(source, value, self.first_ints, self.symbolic_ints, "becomes symbolic")

    def float_is_input(self, source: Source, value: float, of_object: bool = False) -> bool:
        """Whether the float `value` read from `source` is read as a graph input where a tensor's
        + - * takes it (torch.compile's unspecialized floats): an argument, or with `of_object`
        an attribute of an object that is not a module, reached from an argument or a global
        (`cfg.temperature`; a module's attributes are its settings, constants as under
        torch.compile)."""
        read_from = (LocalSource, GlobalSource) if of_object else LocalSource
        return isinstance(_root(source) if of_object else source, read_from) and value == value and \
            self._number_varies(source, value, self.first_floats, self.input_floats,
                                "becomes a graph input where a tensor's + - * takes it")

    def _number_varies(self, source: Source, value: object, first_values: dict, varying: set, what: str) -> bool:
        """Whether the number `value` read from `source` is treated as varying: under
        dynamic=True from the first call, under dynamic=None once a call brings another value."""
        if self.dynamic is False:
            return False
        name = source.name()
        first = first_values.setdefault(name, value)
        if self.dynamic is None and name not in varying:
            if first == value:
                return False
            varying.add(name)
            logs.get("dynamic").info("%s %s: value changed from %r to %r (automatic dynamic)", name, what, first, value)
        return True

    def _notice_changes(self, name: str, real: torch.Tensor) -> None:
        sizes = tuple(real.shape)
        first = self.first_sizes.setdefault(name, sizes)
        if len(first) != len(sizes):
            return
        for d, (was, now) in enumerate(zip(first, sizes)):
            if was != now and d not in self.automatic.get(name, {}):
                why = f"size changed from {was} to {now} (automatic dynamic)"
                self.automatic.setdefault(name, {})[d] = why
                log = logs.get("dynamic")
                if log.isEnabledFor(logging.INFO):
                    log.info("%s: dim %d becomes symbolic: %s", name, d, why)
