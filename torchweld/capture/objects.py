"""Values for objects: `nn.Module` instances (standard ones become `call_module`
nodes, user ones are inlined), user objects, Python modules and classes."""
from __future__ import annotations

import functools
import inspect
import types
from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.collection_values import COLLECTION_CLASSES, construct_collection
from torchweld.capture.ddp import is_ddp
from torchweld.capture.ddp_no_sync import no_sync_method
from torchweld.capture.native_hooks import is_fsdp_managed
from torchweld.capture.optimizers import OptimizerStepValue, captures_step
from torchweld.capture.sources import AttrSource, ModuleEntrySource, Source
from torchweld.capture.values import ConstantValue, GuardedOnUseNumber, ListValue, Value, const
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


def is_standard_module(module: torch.nn.Module) -> bool:
    """A layer of torch.nn (nn.Linear, nn.ReLU, nn.BatchNorm2d), whose forward is a function of
    its parameters, buffers and inputs: called as one graph node. Wrappers that live elsewhere
    under torch (DataParallel, DistributedDataParallel, FSDP, checkpoint wrappers) run Python
    around their module, and subclasses users define may change anything: neither is a leaf."""
    return (type(module).__module__.startswith("torch.nn.modules.") and type(module) not in _CONTAINERS
            and "forward" not in module.__dict__)


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def is_stateless_standard_module(module: torch.nn.Module) -> bool:
    """nn.ReLU, nn.CrossEntropyLoss(): no parameters, buffers or children. Their forward is
    inlined and their settings guarded by value, so a fresh instance per call is no recompile."""
    return (is_standard_module(module) and not module._parameters and not module._modules
            and all(b is None for b in module._buffers.values()))


def _has_hooks(module: torch.nn.Module) -> bool:
    """Forward or backward hooks on `module`, or global module hooks (checked on every call
    of a compiled module, so: plain truth tests of the hook dicts)."""
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def guard_plain_call(tx: "Translator", module: torch.nn.Module, source: Source | None) -> None:
    """Guard what calling `module` without its hooks assumed: that it has none, nor do all
    modules (torch.nn.modules.module's global hooks), and its forward is its class's."""
    from torchweld.capture.guards import GLOBAL_MODULE_HOOK_DICTS
    from torchweld.capture.sources import ModuleGlobalSource

    guards = tx.output.guards
    for name in GLOBAL_MODULE_HOOK_DICTS:
        hooks = getattr(torch.nn.modules.module, name)
        guards.no_global_hooks(ModuleGlobalSource("torch.nn.modules.module", name), type(hooks))
    if source is not None:
        guards.plain_module(source)


def guard_leaf_state(tx: "Translator", module: torch.nn.Module, source: Source) -> None:
    """A graph-leaf module's parameters and buffers (its children's too), which the graph's
    example values and a backend's kernels assumed: each the same tensor, with the same dtype,
    device and requires_grad (`lin.double()` changes a parameter in place; `requires_grad_(False)`
    too). Their shapes are not checked at each call: only `param.data = other` changes them."""
    guards = tx.output.guards
    for name, child in module.named_modules(remove_duplicate=False):
        child_source = source
        for part in name.split(".") if name else ():
            child_source = ModuleEntrySource(child_source, part, "_modules")
        if name:
            guards.identity(child_source, child)
        for store in ("_parameters", "_buffers"):
            for key, tensor in child.__dict__[store].items():
                entry = ModuleEntrySource(child_source, key, store)
                if tensor is None:
                    guards.constant(entry, None)
                    continue
                guards.identity(entry, tensor)
                guards.held_tensor(entry, tensor)


def attribute_source(source: Source, obj: object, name: str) -> AttrSource:
    """The source of `obj.name`: read from the module's own dict where `nn.Module.__getattr__`
    would find it (not shadowed by the instance or its class), else as a plain attribute."""
    if isinstance(obj, torch.nn.Module) and name not in obj.__dict__ \
            and inspect.getattr_static(type(obj), name, None) is None:
        for store in ("_parameters", "_buffers", "_modules"):
            if name in obj.__dict__.get(store, ()):
                return ModuleEntrySource(source, name, store)
    return AttrSource(source, name)


def _attribute(tx: "Translator", owner: Value, obj: object, name: str, source: Source | None) -> Value:
    """`obj.name` for a module or user object, looked up the way Python does."""
    from torchweld.capture.builder import wrap
    from torchweld.capture.callables import BoundMethodValue

    stored = tx.output.side_effects.stored_attribute(obj, name)
    if stored is not None:  # set earlier in this frame
        return stored
    attr_source = attribute_source(source, obj, name) if source is not None else None
    cls_attr = inspect.getattr_static(type(obj), name, None)
    if isinstance(cls_attr, property):
        getter = wrap(tx, cls_attr.fget, AttrSource(AttrSource(attr_source_for_type(source), name), "fget") if source else None)
        return getter.call(tx, [owner], {})
    if isinstance(cls_attr, types.FunctionType) and name not in getattr(obj, "__dict__", {}):
        func_source = AttrSource(attr_source, "__func__") if attr_source else None
        return BoundMethodValue(wrap(tx, cls_attr, func_source), owner, attr_source)
    try:  # a staticmethod reads as its function, a classmethod as a method bound to the class
        value = getattr(obj, name)
    except AttributeError:
        raise Unsupported(f"{type(obj).__name__} object has no attribute {name!r}") from None
    if type(value) is float and attr_source is not None and not isinstance(obj, torch.nn.Module) \
            and tx.output.dims is not None and tx.output.dims.float_is_input(attr_source, value, of_object=True):
        return GuardedOnUseNumber(value, attr_source, tx.output.guards)  # `cfg.temperature` that varies
    return wrap(tx, value, attr_source)


def _store_attribute(tx: "Translator", owner: Value, obj: object, name: str, value: Value) -> None:
    """`obj.name = value` on an object from outside the frame: replayed after the graph."""
    if owner.source is None:
        raise Unsupported(f"setting {name!r} of a {type(obj).__name__} reached without a source")
    setter = inspect.getattr_static(type(obj), "__setattr__", object.__setattr__)
    descriptor = inspect.getattr_static(type(obj), name, None)
    if isinstance(obj, torch.nn.Module):
        if name in obj._parameters or name in obj._buffers or name in obj._modules or name == "training" \
                or isinstance(value, (NNModuleValue,)) or value.python_type() is torch.nn.Parameter:
            raise Unsupported(f"setting {type(obj).__name__}.{name} changes the module's registered state")
    elif setter is not object.__setattr__:
        raise Unsupported(f"{type(obj).__qualname__} defines __setattr__; setting {name!r} needs Python")
    if hasattr(descriptor, "__set__"):
        raise Unsupported(f"{type(obj).__qualname__}.{name} is a property or descriptor; setting it needs Python")
    tx.output.side_effects.store_attribute(owner, obj, name, value)


def attr_source_for_type(source: Source) -> Source:
    return AttrSource(source, "__class__")


# nn.Module's generators over its tree: what each yields (the store its items live in); module_walks.py
MODULE_WALKS = {"parameters": "_parameters", "named_parameters": "_parameters", "buffers": "_buffers",
                "named_buffers": "_buffers", "children": "_modules", "named_children": "_modules",
                "modules": "_modules", "named_modules": "_modules"}


class NNModuleValue(Value):
    def __init__(self, module: torch.nn.Module, source: Source | None = None):
        self.module = module
        self.source = source

    def real_object(self) -> object:
        return self.module

    def python_type(self) -> type:
        return type(self.module)

    def as_constant(self) -> object:
        return self.module

    def getattr(self, tx, name):
        if name == "training":
            if self.source is not None:
                tx.output.guards.constant(AttrSource(self.source, "training"), self.module.training)
            return ConstantValue(self.module.training)
        if name == "no_sync" and is_ddp(self.module):
            no_sync = no_sync_method(tx, self)
            if no_sync is not None:
                return no_sync
        if name in MODULE_WALKS and self.source is not None \
                and inspect.getattr_static(type(self.module), name) is getattr(torch.nn.Module, name):
            from torchweld.capture.module_walks import ModuleWalkValue

            return ModuleWalkValue(self, name)
        return _attribute(tx, self, self.module, name, self.source)

    def setattr(self, tx, name, value):
        _store_attribute(tx, self, self.module, name, value)

    def guard_children(self, tx) -> None:
        """The graph unrolled this container's children: guard their names (so their number)."""
        if self.source is not None:
            tx.output.guards.dict_keys(AttrSource(self.source, "_modules"), list(self.module._modules))

    def items(self, tx):
        from torchweld.capture.builder import wrap

        m = self.module
        self.guard_children(tx)
        if isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList)):
            return [wrap(tx, child, attribute_source(self.source, m, key) if self.source else None)
                    for key, child in m._modules.items()]
        if isinstance(m, torch.nn.ModuleDict):
            return [const(k) for k in m._modules]
        raise Unsupported(f"cannot iterate over module {type(m).__name__}")

    def getitem(self, tx, key: Value) -> Value:
        from torchweld.capture.builder import wrap

        m, k = self.module, key.as_constant()
        if isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList)):
            self.guard_children(tx)  # `layers[-1]` is another module once one is appended
        if isinstance(m, torch.nn.ModuleDict):
            return wrap(tx, m[k], attribute_source(self.source, m, k) if self.source else None)
        if isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList)):
            if isinstance(k, slice):  # `self.layers[:n]`: the modules themselves, each read from its source
                children = self.items(tx)[k]
                return SequentialSliceValue(children) if isinstance(m, torch.nn.Sequential) else ListValue(children)
            child_name = list(m._modules)[k]
            return wrap(tx, m[k], attribute_source(self.source, m, child_name) if self.source else None)
        raise Unsupported(f"indexing module {type(m).__name__}")

    def call(self, tx, args, kwargs):
        from torchweld.capture import module_hooks

        m = self.module
        if is_ddp(m):
            raise Unsupported("DistributedDataParallel runs its bookkeeping for the backward in Python: "
                              "its module is captured in a graph of its own (capture/ddp.py)")
        if is_fsdp_managed(m):
            raise Unsupported("FSDP2's hooks gather and free the module's parameters: they run in Python, "
                              "and the module's forward is captured in a graph of its own (capture/native_hooks.py)")
        if _has_hooks(m):  # as nn.Module.__call__ runs them, around the forward (inlined: a graph's
            # call_module node would run the module's hooks a second time)
            forward = _attribute(tx, self, m, "forward", self.source)
            return module_hooks.call_with_hooks(tx, self, args, kwargs, lambda a, k: forward.call(tx, a, k))
        guard_plain_call(tx, m, self.source)
        return self._forward(tx, args, kwargs)

    def _forward(self, tx, args, kwargs):
        m = self.module
        if is_standard_module(m) and not is_stateless_standard_module(m):
            if self.source is None:
                raise Unsupported(f"calling a {type(m).__name__} made inside the compiled function")
            tx.output.guards.constant(AttrSource(self.source, "training"), m.training)
            guard_leaf_state(tx, m, self.source)
            return tx.output.call_module(m, self.source, args, kwargs)
        forward = _attribute(tx, self, m, "forward", self.source)
        return forward.call(tx, args, kwargs)

    def __repr__(self) -> str:
        return f"NNModuleValue({type(self.module).__name__}, {self.source})"


class SequentialSliceValue(ListValue):
    """`seq[a:b]` of an nn.Sequential: its modules, which calling it runs in order."""

    def call(self, tx, args, kwargs):
        if kwargs or len(args) != 1:
            raise Unsupported("a slice of a Sequential takes one input")
        (value,) = args
        for module in self.elements:
            value = module.call(tx, [value], {})
        return value


class UserObjectValue(Value):
    """An instance of a user class: attributes are read through its source."""

    def __init__(self, obj: object, source: Source | None = None):
        self.obj = obj
        self.source = source

    def real_object(self) -> object:
        return self.obj

    def python_type(self) -> type:
        return type(self.obj)

    def getattr(self, tx, name):
        if self.source is None:
            raise Unsupported(f"reading {name!r} of a {type(self.obj).__name__} without a source")
        if name == "step" and captures_step(self.obj):
            return OptimizerStepValue(self)
        return _attribute(tx, self, self.obj, name, self.source)

    def setattr(self, tx, name, value):
        _store_attribute(tx, self, self.obj, name, value)

    def truth(self, tx):
        """`bool(obj)`: its class's Python __bool__ or __len__, inlined; true where it has neither
        (the type is guarded where the object came from)."""
        for dunder in ("__bool__", "__len__"):
            method = inspect.getattr_static(type(self.obj), dunder, None)
            if isinstance(method, types.FunctionType):
                return self.getattr(tx, dunder).call(tx, [], {}).truth(tx)
            if method is not None:
                return super().truth(tx)  # a builtin's __bool__ or __len__ (a dict subclass, ...)
        return True

    def call(self, tx, args, kwargs):
        if not isinstance(inspect.getattr_static(type(self.obj), "__call__", None), types.FunctionType):
            raise Unsupported(f"call to {type(self.obj).__qualname__} object, which capture does not model")
        call = _attribute(tx, self, self.obj, "__call__", self.source)
        return call.call(tx, args, kwargs)

    def __repr__(self) -> str:
        return f"UserObjectValue({type(self.obj).__name__}, {self.source})"


# Python modules whose attributes are trusted not to be monkey-patched: reading
# `torch.sin` or `math.pi` adds no guard beyond the module's own identity.
TRUSTED_MODULE_PREFIXES = ("torch", "math", "operator", "builtins", "numbers", "collections", "typing", "functools")


class PythonModuleValue(Value):
    def __init__(self, module: types.ModuleType, source: Source | None = None):
        self.module = module
        self.source = source

    def real_object(self) -> object:
        return self.module

    def python_type(self) -> type:
        return types.ModuleType

    def as_constant(self) -> object:
        return self.module

    def getattr(self, tx, name):
        from torchweld.capture.builder import wrap

        try:
            value = getattr(self.module, name)
        except AttributeError:
            raise Unsupported(f"module {self.module.__name__} has no attribute {name!r}") from None
        trusted = self.module.__name__.split(".")[0] in TRUSTED_MODULE_PREFIXES
        source = AttrSource(self.source, name) if self.source is not None else None
        # functions, classes and modules of a trusted module are not monkey-patched; its settings
        # are changed all the time (torch.backends.cudnn.enabled, torch.backends.cuda.matmul.allow_tf32)
        setting = type(value) in (bool, int, float, str, type(None))
        return wrap(tx, value, source, guard=setting or not trusted)

    def __repr__(self) -> str:
        return f"PythonModuleValue({self.module.__name__})"


class ClassValue(Value):
    def __init__(self, cls: type, source: Source | None = None):
        self.cls = cls
        self.source = source

    def real_object(self) -> object:
        return self.cls

    def python_type(self) -> type:
        return type(self.cls)

    def as_constant(self) -> object:
        return self.cls

    def getattr(self, tx, name):
        from torchweld.capture.builder import wrap

        if name in ("__name__", "__qualname__", "__module__", "__doc__"):
            return const(getattr(self.cls, name))
        if name == "apply" and isinstance(self.cls, type) and issubclass(self.cls, torch.autograd.Function):
            # a custom autograd.Function: one node of the graph, its own backward kept (not inlined)
            from torchweld.capture.callables import TorchCallableValue

            source = AttrSource(self.source, name) if self.source else None
            return TorchCallableValue(autograd_function_apply(self.cls), source)
        value = inspect.getattr_static(self.cls, name)
        if isinstance(value, (staticmethod, classmethod)):
            value = getattr(self.cls, name)
        holder = self.source or tx.output.guards.source_of(self.cls)  # `type(obj).scale` changes too
        return wrap(tx, value, AttrSource(holder, name))

    def call(self, tx, args, kwargs):
        from torchweld.capture.mode_calls import mode_call

        special = mode_call(tx, self.cls, args, kwargs)
        if special is not None:
            return special
        if self.cls is torch.Size:
            return const(torch.Size(*[a.as_constant() for a in args]))
        if self.cls is functools.partial and args:
            from torchweld.capture.callables import PartialValue

            return PartialValue(args[0], list(args[1:]), dict(kwargs))
        if isinstance(self.cls, type) and issubclass(self.cls, torch.nn.Module) and self.cls.__module__.startswith("torch.nn."):
            instance = self.cls(*[a.as_constant() for a in args], **{k: v.as_constant() for k, v in kwargs.items()})
            if is_stateless_standard_module(instance):  # nn.CrossEntropyLoss(): built now, once
                return NNModuleValue(instance)
            raise Unsupported(f"creating a {self.cls.__qualname__} (a module with parameters) inside a compiled function")
        if self.cls in COLLECTION_CLASSES:  # deque(), defaultdict(list)
            return construct_collection(tx, self.cls, args, kwargs)
        if isinstance(self.cls, type) and issubclass(self.cls, BaseException):  # raise ValueError("no")
            return construct_exception(self.cls, args, kwargs)
        if self.cls in (torch.device, torch.dtype, torch.finfo, torch.iinfo):
            return const(self.cls(*[a.as_constant() for a in args], **{k: v.as_constant() for k, v in kwargs.items()}))
        from torchweld.capture.new_objects import construct

        return construct(tx, self, args, kwargs)

    def __repr__(self) -> str:
        return f"ClassValue({self.cls.__qualname__})"


@functools.lru_cache(maxsize=None)
def autograd_function_apply(cls: type) -> Callable:
    """`cls.apply` as a function of its own, which the graph's code refers to as an object (a
    bound classmethod of a torch class would be written as `torch.autograd.function.apply`)."""

    def apply(*args, **kwargs):
        return cls.apply(*args, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
    return apply


def construct_exception(cls: type, args: list[Value], kwargs: dict[str, Value]) -> Value:
    """An exception object made in the frame, where its class stores only its arguments."""
    from torchweld.capture.exceptions import ExceptionValue

    own_init = any("__init__" in vars(k) or "__new__" in vars(k)
                   for k in cls.__mro__[:cls.__mro__.index(BaseException)] if k.__flags__ & (1 << 9))
    if kwargs or own_init:
        raise Unsupported(f"creating a {cls.__qualname__} with keyword arguments or its own __init__")
    return ExceptionValue(cls, args)


class SuperValue(Value):
    """`super()` inside an inlined method: attribute lookup starts after `cls` in the MRO."""

    def __init__(self, cls: type, owner: Value):
        self.cls = cls
        self.owner = owner

    def getattr(self, tx, name):
        from torchweld.capture.builder import wrap
        from torchweld.capture.callables import BoundMethodValue
        from torchweld.capture.new_objects import NewObjectValue
        from torchweld.capture.sources import ItemSource

        if isinstance(self.owner, NewObjectValue):
            return self.owner.class_attribute(tx, name, after=self.cls)
        real = self.owner.real_object()
        if real is None:
            raise Unsupported(f"super() of {self.owner}")
        mro = type(real).__mro__
        for i in range(mro.index(self.cls) + 1, len(mro)):
            attr = vars(mro[i]).get(name)
            if attr is None:
                continue
            if mro[i] in (dict, list, tuple) and name in _READ_ONLY_BUILTIN_METHODS:
                return BuiltinBaseMethodValue(mro[i], name, self.owner, real)
            if not isinstance(attr, types.FunctionType):
                raise Unsupported(f"super().{name}: {mro[i].__qualname__}.{name} is not a Python function")
            source = None
            if self.owner.source is not None:
                klass = ItemSource(AttrSource(AttrSource(self.owner.source, "__class__"), "__mro__"), i)
                source = ItemSource(AttrSource(klass, "__dict__"), name)
            return BoundMethodValue(wrap(tx, attr, source), self.owner)
        raise Unsupported(f"super() has no attribute {name!r}")


_READ_ONLY_BUILTIN_METHODS = {"get", "__getitem__", "__contains__", "__len__"}


class BuiltinBaseMethodValue(Value):
    """`super().get(key)` in a dict subclass: run on the real object at capture time,
    the result read back (and guarded) through a source that calls the same method."""

    def __init__(self, base_type: type, name: str, owner: Value, real: object):
        self.base_type, self.name, self.owner, self.real = base_type, name, owner, real

    def call(self, tx, args, kwargs):
        from torchweld.capture.builder import wrap
        from torchweld.capture.sources import BuiltinMethodCallSource

        if self.owner.source is None or kwargs:
            raise Unsupported(f"{self.base_type.__name__}.{self.name} on an object without a source")
        constants = tuple(a.as_constant() for a in args)
        result = getattr(self.base_type, self.name)(self.real, *constants)
        source = BuiltinMethodCallSource(self.base_type.__name__, self.name, self.owner.source, constants)
        return wrap(tx, result, source)
