"""Python source that rebuilds a Value as a real object after the graph ran:
graph outputs by index, inputs by their source, constants by value.

Soundness (README, "Soundness"): what this writes is recomputed at every call. Values read
from outside are read anew through their sources, before any side effect is replayed;
objects made in the frame are built anew; the only objects named as constants are those
that are the same at every call (`same_object_every_call`: classes, modules, functions not
bound to an object). Anything else cannot be rebuilt, and capture breaks or runs eagerly."""
from __future__ import annotations

import collections
import copy
import types

import torch

from torchweld.capture.autocast import AutocastExitValue
from torchweld.capture.collection_values import DefaultDictValue, DequeValue, SetValue
from torchweld.capture.exceptions import ExceptionValue
from torchweld.capture.grad_mode import GradModeExitValue, entered_again
from torchweld.capture.new_objects import NewObjectValue
from torchweld.capture.objects import NNModuleValue
from torchweld.capture.python_contexts import PythonContextExitValue
from torchweld.capture.sources import LocalSource, Source
from torchweld.capture.values import (
    ConstantValue, DictValue, GuardedOnUseNumber, IteratorValue, ListValue, SymNumberValue, TensorTruthValue, TensorValue,
    TupleValue, Value,
)
from torchweld.errors import Unsupported

_LITERAL_TYPES = (type(None), bool, int, str, bytes)


class Reconstructor:
    """Collects the graph outputs an expression needs and the objects it names."""

    def __init__(self) -> None:
        self.graph_outputs: list[TensorValue] = []
        self._output_index: dict[torch.fx.Node, int] = {}
        self.constants: dict[str, object] = {}
        self.lines: list[str] = []  # statements that build shared objects, run after the graph
        self._built: dict[int, str] = {}  # id(Value) -> the temporary holding its object
        self._reads: dict[str, str] = {}  # source name -> the temporary holding its value

    def _build_once(self, value: Value, make_expr) -> str:
        """Build a mutable object once, so that every reference to it is the same object."""
        name = self._built.get(id(value))
        if name is None:
            name = self._built[id(value)] = f"___t{len(self._built)}"
            self.lines.append(f"{name} = {make_expr()}")
        return name

    def _new_object(self, value: NewObjectValue) -> str:
        """An object made in the frame: created bare, then given the attributes and
        entries its inlined `__init__` and later stores computed. Named before its
        contents are built, so that an object referring to itself is rebuilt too."""
        name = self._built.get(id(value))
        if name is not None:
            return name
        name = self._built[id(value)] = f"___t{len(self._built)}"
        cls = self.const(value.cls)
        self.lines.append(f"{name} = {cls}.__new__({cls})")
        if value.entries is not None:
            setitem = self.const(value.base.__setitem__)
            for key, item in value.entries.entries.items():
                self.lines.append(f"{setitem}({name}, {self.const(key)}, {self.expr(item)})")
        attributes = ", ".join(f"{key!r}: {self.expr(item)}" for key, item in value.attributes.entries.items())
        if attributes:
            self.lines.append(f"{name}.__dict__.update({{{attributes}}})")
        return name

    def const(self, obj: object) -> str:
        name = f"___c{len(self.constants)}"
        self.constants[name] = obj
        return name

    def read(self, source: Source) -> str:
        """`source`'s value, read into a temporary before any side effect is replayed: the frame
        saw every outside object as it was before its own changes, which replay after the graph
        (`old = self.w; self.w = y; return old` returns the old tensor)."""
        if isinstance(source, LocalSource):  # the entry's own parameter: nothing rebinds it
            return source.expr()
        name = self._reads.get(source.name())
        if name is None:
            name = self._reads[source.name()] = f"___r{len(self._reads)}"
            self.lines.append(f"{name} = {source.expr()}")
        return name

    def expr(self, value: Value) -> str:
        if isinstance(value, TensorValue):
            if value.node.op == "placeholder" and value.source is not None:
                return self.read(value.source)
            if value.node not in self._output_index:
                self._output_index[value.node] = len(self.graph_outputs)
                self.graph_outputs.append(value)
            return f"___out[{self._output_index[value.node]}]"
        if isinstance(value, PythonContextExitValue):  # a break inside the block of a `with`
            return f"{self.expr(value.manager)}.__exit__"
        if isinstance(value, TensorTruthValue):
            return f"bool({self.expr(value.tensor)})"
        if isinstance(value, SymNumberValue):  # `x.shape[0] // 2`: computed again from the inputs' sizes
            spelled = value.output.spell_size(value.sym, self.read, self.const)
            if spelled is None:
                return repr(value.as_constant())
            # a float stays one where the expression simplifies to an integer (`0.0 * n` is 0)
            return f"float{spelled}" if value.python_type() is float else spelled
        if isinstance(value, GuardedOnUseNumber):  # a float read as a graph input: read anew, not guarded
            return self.read(value.source)
        if isinstance(value, ConstantValue):
            v = value.as_constant()  # written into the code: a number read from outside is guarded now
            if type(v) in _LITERAL_TYPES or (type(v) is float and v == v and v not in (float("inf"), -float("inf"))):
                return repr(v)
            return self.const(v)
        if isinstance(value, DequeValue):
            return self._build_once(value, lambda: f"{self.const(collections.deque)}(["
                                    + ", ".join(self.expr(v) for v in value.elements) + f"], {value.maxlen!r})")
        if isinstance(value, DefaultDictValue):
            return self._build_once(value, lambda: f"{self.const(collections.defaultdict)}({self.expr(value.factory)}, {{"
                                    + ", ".join(f"{self.const(k)}: {self.expr(v)}" for k, v in value.entries.items()) + "})")
        if isinstance(value, ListValue):
            if value.source is not None:  # the real list (side effects write its new contents back)
                return self.read(value.source)
            return self._build_once(value, lambda: "[" + ", ".join(self.expr(v) for v in value.elements) + "]")
        if isinstance(value, TupleValue):
            if value.source is not None:
                return self.read(value.source)
            items = ", ".join(self.expr(v) for v in value.elements)
            if value.fields and hasattr(value.tuple_type, "_fields"):  # collections.namedtuple
                return f"{self.const(value.tuple_type)}({items})"
            if value.fields:  # a structseq such as torch.return_types.max
                return f"{self.const(value.tuple_type)}(({items},))"
            if value.tuple_type is torch.Size:  # `x.size()` with symbolic sizes among its items
                return f"{self.const(torch.Size)}(({items},))"
            return f"({items},)" if value.elements else "()"
        if isinstance(value, DictValue):
            if value.source is not None:
                return self.read(value.source)
            return self._build_once(
                value, lambda: "{" + ", ".join(f"{self.const(k)}: {self.expr(v)}" for k, v in value.entries.items()) + "}"
            )
        if isinstance(value, SetValue):  # a copy of the set capture holds, made at each call
            return self._build_once(value, lambda: f"{value.python_type().__name__}({self.const(value.as_constant())})")
        if isinstance(value, IteratorValue):
            return self._build_once(value, lambda: "iter([" + ", ".join(self.expr(v) for v in value.remaining) + "])")
        if isinstance(value, NewObjectValue):
            return self._new_object(value)
        if isinstance(value, ExceptionValue):  # made anew, as `raise ValueError(...)` makes it
            return f"{self.const(value.exc_type)}({', '.join(self.expr(a) for a in value.args)})"
        if isinstance(value, GradModeExitValue):  # inside `with torch.no_grad():` - enter it again
            context = value.context
            ctx = self._build_once(value, lambda: f"{self.const(entered_again)}({context.enabled}, {context.previous})")
            return f"{ctx}.__exit__"
        if isinstance(value, AutocastExitValue):  # inside `with torch.autocast(...)`: enter it again
            args = ", ".join(self.const(a) for a in value.context.args)
            ctx = self._build_once(value, lambda: f"{self.const(torch.amp._enter_autocast)}({args})")
            return f"{ctx}.__exit__"
        if value.source is not None:
            return self.read(value.source)
        real = value.real_object()
        if isinstance(value, NNModuleValue) and real is not None:  # nn.ReLU() made in the frame: new per call
            return f"{self.const(copy.deepcopy)}({self.const(real)})"
        if real is not None and same_object_every_call(real):
            return self.const(real)
        raise Unsupported(f"returning {value}, made inside the compiled function, is not supported yet")


def same_object_every_call(obj: object) -> bool:
    """Whether generated code may name `obj` as a constant: a class, module or function,
    or a builtin not bound to an object (`len`, `torch.sin`), is the same at every call.
    A method bound to an object (`s.add` of a set made in the frame) is not: it is
    rebuilt from its source or the break cannot be made."""
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodDescriptorType,
                        types.WrapperDescriptorType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(obj, types.BuiltinFunctionType):
        owner = obj.__self__
        return owner is None or isinstance(owner, (types.ModuleType, type))
    return False
