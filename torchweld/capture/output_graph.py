"""The FX graph one translation builds: placeholders for the tensors that enter
the frame (named after their sources), one node per tensor operation with its
fake-tensor example value, and the guards the translation collected."""
from __future__ import annotations

import contextlib
import logging
import operator
import re
import threading
from typing import Callable

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode, UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import DimDynamic
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from torchweld import fake_memo
from torchweld.node_effects import is_pure_node, writes_first_argument
from torchweld.capture import dtype_refusals
from torchweld.capture.dynamic_dims import DimChoices
from torchweld.capture.guards import GuardSet, autocast_state
from torchweld.capture.module_fakes import batch_norm_example
from torchweld.capture.side_effects import SideEffects
from torchweld.capture.symbolic_sizes import (
    SIZES_GUARDED, CaptureShapeEnv, IntSource, SizeGuard, SymbolicInput, is_symbolic, specialized_marks, spell_over_inputs,
    symbolic_fake,
)
from torchweld.capture.number_inputs import NumberTensor
from torchweld.capture.number_operands import take_numbers
from torchweld.capture.sources import ModuleEntrySource, NumberTensorSource, Source
from torchweld.capture.values import (
    ConstantValue, SymNumberValue, TensorValue, TupleValue, Value, const, is_constant_literal,
)
from torchweld.errors import Unsupported
from torchweld.fake_tensors import fake_copy, over_symbols
from torchweld.write_refusals import overlap_refusal


class OutputGraph:
    def __init__(self, root_globals: dict, dims: DimChoices | None = None):
        self.root_globals = root_globals
        self.dims = dims  # which input dims are symbolic (dynamic_dims.py); None: none
        self.shape_env: CaptureShapeEnv | None = None  # made at the first symbolic dim
        self.symbolic_inputs: list[SymbolicInput] = []
        self.translators: list = []  # the running Translators, innermost last: where a size guard comes from
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()  # owns the submodules `call_module` nodes name
        self.guards = GuardSet()
        self.side_effects = SideEffects()
        # exceptions raised in captured code unwind to captured handlers (capture/exceptions.py);
        # False: each ends the capture where it is raised (a retry where a handler cannot be rebuilt)
        self.model_exceptions = True
        self.caught_raise = False  # a captured handler caught one
        self.mutable_inputs: dict[int, tuple[object, Value]] = {}  # id -> (list/dict, its one Value)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.grad_enabled = self.initial_grad_enabled = torch.is_grad_enabled()
        self.grad_mode_changed = False
        # open `with torch.autocast(...)` regions, outermost first: (enter node, its arguments)
        self.autocast_regions: list[tuple[torch.fx.Node, tuple]] = []
        self.guards.grad_mode(self.grad_enabled)
        self.guards.autocast(autocast_state())
        # what factory functions make (torch.ones(3)) and the device or mode contexts around them
        self.guards.process_state(torch.get_default_dtype, torch.get_default_dtype(), "torch.get_default_dtype()")
        self.guards.process_state(torch._C._len_torch_function_stack, torch._C._len_torch_function_stack(),
                                  "the number of active torch function modes (torch.set_default_device, ...)")
        self.inputs: list[tuple[Source, torch.Tensor, torch.fx.Node]] = []
        self._input_by_source: dict[str, TensorValue] = {}
        self.number_input_sources: set[str] = set()  # names of floats to read as GuardedOnUseNumber
        self._number_inputs: dict[tuple, TensorValue] = {}  # (formula, device, dtype) -> placeholder
        self._input_by_id: dict[int, TensorValue] = {}
        self._module_names: dict[int, str] = {}
        self._fakes: dict[int, torch.Tensor] = {}  # id(real parameter or buffer) -> its fake copy
        self._keep_alive: list[torch.Tensor] = []

    # -- inputs ----------------------------------------------------------------
    def input_tensor(self, source: Source, real: torch.Tensor, by_identity: bool = False) -> TensorValue:
        """The placeholder for a tensor read from `source` (one per distinct tensor), guarded
        on its metadata, or with `by_identity` on being the same tensor object (for tensors
        only their owner remakes, whose metadata another guard fixes: an optimizer's state)."""
        known = self._input_by_source.get(source.name())
        if known is not None:
            return known
        same_tensor = self._input_by_id.get(id(real))
        symbolic, fake = {}, None
        if by_identity:
            self.guards.identity(source, real)
        elif same_tensor is not None:
            self.guards.tensor(source, real, _symbolic_dims(same_tensor.fake))
        else:
            symbolic = self.dims.choose(source, real) if self.dims is not None else {}
            if symbolic and not real.is_sparse and type(real) is torch.Tensor:
                fake = symbolic_fake(self.fake_mode, self._shape_env(), real, source, symbolic)
            self.guards.tensor(source, real, _symbolic_dims(fake) if fake is not None else ())
        if same_tensor is not None:  # one tensor reached two ways: one placeholder keeps them aliased,
            self.guards.same_object(source, same_tensor.source)  # which holds while they are one tensor
            self._input_by_source[source.name()] = same_tensor
            return same_tensor
        if real.is_sparse or type(real) not in (torch.Tensor, torch.nn.Parameter, torch.nn.parameter.Buffer):
            raise Unsupported(f"{source.name()} is a {type(real).__name__}; only dense torch.Tensor inputs are captured")
        try:
            fake = fake if fake is not None else fake_copy(self.fake_mode, real)
        except RuntimeError as e:  # autograd refuses to describe it (a no-grad view of a base changed since)
            raise Unsupported(f"{source.name()} cannot be described to capture: {str(e).splitlines()[0]}") from None
        with self._insert_placeholder():
            node = self.graph.placeholder(source.placeholder_name())
        node.meta["example_value"] = fake
        node.meta["source"] = source.name()
        if by_identity or _module_state(source):  # the same tensor at every call (by its guard), or a
            # module's parameter or buffer (a KV cache): CUDA graphs read it in place, recording
            # again where it moved, instead of copying it in (and back, where the graph writes it)
            node.meta["static_address"] = True
        value = TensorValue(node, fake, source, cls=type(real))
        if _symbolic_dims(fake):
            self.symbolic_inputs.append(SymbolicInput(source, fake, {d for d in symbolic if symbolic[d][1]}))
        self.inputs.append((source, real, node))
        self._input_by_source[source.name()] = value
        self._input_by_id[id(real)] = value
        return value

    def input_int(self, source: Source, value: int) -> SymNumberValue:
        """The placeholder for an int argument read as a symbol (dynamic_dims.int_is_symbolic):
        guarded on its type here, its value by the size guard's relations."""
        known = self._input_by_source.get(source.name())
        if known is not None:
            return known
        env = self._shape_env()
        where = IntSource(source.name())
        # not a size: any sign, and 0 and 1 symbols too (torch.compile's unspecialized ints)
        symbol = env.create_unspecified_symbol(value, where, dynamic_dim=DimDynamic.DYNAMIC)
        sym = env.create_symintnode(symbol, hint=value, source=where)
        self.guards.type_is(source, int)
        with self._insert_placeholder():
            node = self.graph.placeholder(source.placeholder_name())
        node.meta["example_value"] = sym
        node.meta["source"] = source.name()
        result = SymNumberValue(node, sym, self)
        self.symbolic_inputs.append(SymbolicInput(source, sym, set()))
        self.inputs.append((source, value, node))
        self._input_by_source[source.name()] = result
        return result

    def input_number(self, source: Source, value: float, device: torch.device, dtype: torch.dtype,
                     formula: str = "{}", compute: Callable[[float], float] | None = None) -> TensorValue:
        """The placeholder for `compute` of the float read from `source` (`formula` spells
        it over the source's name), as a 0-d `dtype` tensor on `device` that the entry
        refills when the number changes (number_inputs.py). The number's type is guarded
        where it was read (GuardedOnUseNumber), its value not."""
        key = (formula.format(source.name()), str(device), dtype)
        known = self._number_inputs.get(key)
        if known is not None:
            return known
        holder = NumberTensor(value, device, dtype, compute)
        tensor_source = NumberTensorSource(source, self.guards.name_constant(holder), *key)
        name, taken = tensor_source.placeholder_name(), {n.target for n in self.graph.nodes if n.op == "placeholder"}
        if name in taken:  # `-lr` and `lr` spell alike once their punctuation is gone
            name = next(f"{name}{k}_" for k in range(1, len(taken) + 2) if f"{name}{k}_" not in taken)
        with self._insert_placeholder():
            node = self.graph.placeholder(name)
        fake = fake_copy(self.fake_mode, holder.tensor)
        node.meta["example_value"] = fake
        node.meta["source"] = tensor_source.name()
        node.meta["static_address"] = True  # the holder's one tensor: CUDA graphs read it in place
        value = TensorValue(node, fake, tensor_source)
        self.inputs.append((tensor_source, holder.tensor, node))
        self._number_inputs[key] = value
        return value

    def _shape_env(self) -> CaptureShapeEnv:
        if self.shape_env is None:
            self.shape_env = CaptureShapeEnv()
            self.shape_env.user_location = self._user_location
            over_symbols(self.fake_mode, self.shape_env)  # (its fakes made so far keep static sizes)
        return self.shape_env

    def _user_location(self) -> str:
        if not self.translators:
            return "<capture>"
        where = self.translators[-1].location()
        return f"{where} ({where.source_line})"

    def spell_size(self, sym: object, read: Callable[[Source], str], module: Callable[[object], str]) -> str | None:
        """Python computing the symbolic size `sym` from the inputs, each read by `read(source)`,
        the modules it calls by `module(m)`."""
        return spell_over_inputs(self.shape_env, self.symbolic_inputs, sym, read, module)

    @contextlib.contextmanager
    def _insert_placeholder(self):
        first_op = next((n for n in self.graph.nodes if n.op != "placeholder"), None)
        if first_op is None:
            yield
        else:
            with self.graph.inserting_before(first_op):
                yield

    # -- operations --------------------------------------------------------------
    def call_function(self, target: Callable, args: list[Value], kwargs: dict[str, Value]) -> Value:
        target, args, kwargs = take_numbers(self, target, args, kwargs)
        return self._record("call_function", target, target, args, kwargs)

    def call_method(self, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value:
        name, args, kwargs = take_numbers(self, name, args, kwargs)

        def run(self_arg, *rest, **kw):
            return getattr(self_arg, name)(*rest, **kw)

        return self._record("call_method", name, run, args, kwargs)

    def call_module(self, module: torch.nn.Module, source: Source, args: list[Value], kwargs: dict[str, Value]) -> Value:
        name = self._module_names.get(id(module))
        if name is None:
            name = re.sub(r"[^0-9a-zA-Z_]+", "_", source.name()).strip("_").lower()
            while hasattr(self.root, name):
                name += "_"
            self.root.add_module(name, module)
            self._module_names[id(module)] = name
        return self._record("call_module", name, self._with_fake_state(module), args, kwargs)

    def _with_fake_state(self, module: torch.nn.Module):
        """Run `module` on fake copies of its parameters and buffers: a fake run must never
        change the real ones (BatchNorm's running statistics, num_batches_tracked)."""
        def run(*args, **kwargs):
            if not self.autocast_regions:
                example = batch_norm_example(module, list(args), kwargs, self.grad_enabled)
                if example is not None:
                    return example
            state = {name: self._fake_of(t) for name, t in
                     [*module.named_parameters(), *module.named_buffers()]}
            with _reparametrize_module(module, state):
                return module(*args, **kwargs)

        return run

    def _fake_of(self, real: torch.Tensor) -> torch.Tensor:
        fake = self._fakes.get(id(real))
        if fake is None:
            fake = self._fakes[id(real)] = fake_copy(self.fake_mode, real)
            self._keep_alive.append(real)
        return fake

    def set_grad_enabled(self, enabled: bool) -> None:
        if enabled != self.grad_enabled:
            node = self.graph.call_function(torch._C._set_grad_enabled, (enabled,))
            node.meta["example_value"] = None
            self.grad_mode_changed = True
        self.grad_enabled = enabled

    def enter_autocast(self, args: tuple) -> None:
        """Start a `torch.autocast(*args)` region (capture/autocast.py)."""
        node = self.graph.call_function(torch.amp._enter_autocast, args)
        node.meta["example_value"] = None
        self.autocast_regions.append((node, args))

    def exit_autocast(self) -> None:
        """End the innermost autocast region; one with no operation in it leaves no nodes."""
        enter, _ = self.autocast_regions.pop()
        if enter.next.op == "root":  # nothing recorded after it
            self.graph.erase_node(enter)
            return
        node = self.graph.call_function(torch.amp._exit_autocast, (enter,))
        node.meta["example_value"] = None

    def exit_autocast_regions(self) -> None:
        """End every open region: a graph that stops at a break leaves them (the entry enters them again)."""
        while self.autocast_regions:
            self.exit_autocast()

    def in_autocast_regions(self) -> contextlib.AbstractContextManager:
        """The open autocast regions entered for real, for fake runs and state queries."""
        if not self.autocast_regions:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for _, args in self.autocast_regions:
            stack.enter_context(torch.autocast(*args))
        return stack

    def _record(self, op: str, target: object, run: Callable, args: list[Value], kwargs: dict[str, Value]) -> Value:
        example_args = [a.example() for a in args]
        example_kwargs = {k: v.example() for k, v in kwargs.items()}
        if not self.autocast_regions and not torch._C._is_any_autocast_enabled():  # autocast casts them
            _check_matmul_dtypes(target, self.root, [*example_args, *example_kwargs.values()])
            if op != "call_module" and \
                    dtype_refusals.needs_checking(target, [*example_args, *example_kwargs.values()]):
                refused = dtype_refusals.refusal(target, run, example_args, example_kwargs)
                if refused is not None:
                    raise Unsupported(f"{_describe(target)} raised RuntimeError: {refused} (eager's kernel refuses "
                                      "these dtypes; the eager run raises it)")
        if op != "call_module" and writes_first_argument(target) and example_args \
                and isinstance(example_args[0], torch.Tensor):
            refused = overlap_refusal(example_args[0], [*example_args[1:], *example_kwargs.values()])
            if refused is not None:  # fake tensors do not check: the write runs as eager's, raising there
                raise Unsupported(f"{_describe(target)} raised RuntimeError: {refused} (the eager run raises it)")
        result = self._run_fake(run if op == "call_module" else target, run, example_args, example_kwargs)
        if self.shape_env is not None and _has_symbols(result):
            return self._symbolic_result(op, target, args, kwargs, result)
        has_tensor = any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(result))
        if not has_tensor and result is not None:
            if is_constant_literal(result):
                return ConstantValue(result)
            raise Unsupported(f"{_describe(target)} returned a {type(result).__name__}, which capture cannot hold")
        node = self.graph.create_node(
            op, target, tuple(a.node_arg() for a in args), {k: v.node_arg() for k, v in kwargs.items()}
        )
        node.meta["example_value"] = result
        if result is None:  # an operation kept for its side effect
            return ConstantValue(None)
        return self._wrap_result(node, result)

    def _run_fake(self, target: object, run: Callable, args: list, kwargs: dict) -> object:
        try:
            # a capture with symbolic sizes runs under the Python dispatcher, whose meta kernels
            # take symbolic sizes (the CUDA attention's choice of kernel raised "SymIntArrayRef
            # expected to contain only concrete integers" without it: a break at every
            # attention; torch.compile uses it too)
            dispatcher = contextlib.nullcontext() if self.shape_env is None else enable_python_dispatcher()
            with self.fake_mode, dispatcher, fake_memo.Memo(), torch.set_grad_enabled(self.grad_enabled), \
                    self.in_autocast_regions():
                return run(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise Unsupported(f"data-dependent: {_describe(target)} has an output whose value or shape depends on tensor data ({type(e).__name__})") from None
        except UnsupportedOperatorException as e:
            raise Unsupported(f"{_describe(target)}: operator {e} has no fake-tensor rule") from None
        except Unsupported:
            raise
        except Exception as e:  # the user's error: the eager run raises it at the user's line
            raise Unsupported(f"{_describe(target)} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

    def _symbolic_result(self, op: str, target: object, args: list[Value], kwargs: dict[str, Value], result: object) -> Value:
        """A size computed from symbolic sizes: a graph value (a SymInt node), or, for a
        comparison (a SymBool), the answer at capture, which the ShapeEnv now guards."""
        if isinstance(result, torch.SymBool):
            return ConstantValue(bool(result))
        node = self.graph.create_node(
            op, target, tuple(a.node_arg() for a in args), {k: v.node_arg() for k, v in kwargs.items()}
        )
        node.meta["example_value"] = result
        if isinstance(result, (torch.SymInt, torch.SymFloat)):
            return SymNumberValue(node, result, self)
        return self._wrap_result(node, result)

    def size_of(self, tensor: TensorValue) -> Value:
        """`tensor.shape`: a torch.Size where every size is a number, else a tuple of numbers and symbolic sizes."""
        if not any(is_symbolic(n) for n in tensor.fake.shape):
            return ConstantValue(tensor.fake.shape)
        return self.call_method("size", [tensor], {})

    def _wrap_result(self, node: torch.fx.Node, result: object) -> Value:
        if isinstance(result, torch.Tensor):
            return TensorValue(node, result)
        if isinstance(result, (tuple, list)):
            items = []
            for i, item in enumerate(result):
                if isinstance(item, torch.Tensor):
                    getitem = self.graph.call_function(operator.getitem, (node, i))
                    getitem.meta["example_value"] = item
                    items.append(TensorValue(getitem, item))
                elif isinstance(item, (torch.SymInt, torch.SymFloat)):  # beside tensors: its own node
                    getitem = self.graph.call_function(operator.getitem, (node, i))
                    getitem.meta["example_value"] = item
                    items.append(SymNumberValue(getitem, item, self))
                else:
                    items.append(const(item))
            fields = getattr(type(result), "_fields", None) or getattr(type(result), "__match_args__", None)
            if isinstance(result, list):
                from torchweld.capture.values import ListValue

                return ListValue(items)
            return TupleValue(items, fields=tuple(fields) if fields else None, tuple_type=type(result))
        raise Unsupported(f"an operation returned a {type(result).__name__}, which capture cannot hold")

    # -- the result ----------------------------------------------------------------
    def _remove_dead_code(self) -> None:
        """Drop operations whose results nobody uses and that change nothing, and the unused
        operations of a checkpointed block (its checkpoint call runs them: capture/checkpoint.py)."""
        for node in reversed(list(self.graph.nodes)):
            if node.users or node.op not in ("call_function", "call_method", "call_module", "get_attr"):
                continue
            if "checkpoint_region" in node.meta or (node.op != "call_module" and node.op != "get_attr"
                                                    and is_pure_node(node)):
                self.graph.erase_node(node)

    def op_count(self) -> int:
        return sum(1 for n in self.graph.nodes if n.op in ("call_function", "call_method", "call_module"))

    def finish(self, outputs: list[TensorValue]) -> tuple[torch.fx.GraphModule, list[torch.Tensor], list[Source]]:
        """Close the graph with `outputs`; return it, its example inputs and their sources.
        (The grad mode after the graph is set by the entry code, whatever the backend did.)
        The guard on symbolic sizes is added last: it holds everything the ShapeEnv learned."""
        if self.symbolic_inputs:
            specialized_marks(self.shape_env, self.symbolic_inputs)  # raises where a marked dim became a number
            self.guards.sizes(SizeGuard(self.shape_env, self.symbolic_inputs))
        self.graph.output(tuple(v.node for v in outputs))
        self._remove_dead_code()
        kept = []
        for source, real, node in self.inputs:
            if node.users:
                kept.append((source, real))
            else:
                self.graph.erase_node(node)
        gm = torch.fx.GraphModule(self.root, self.graph)
        if self.symbolic_inputs:  # every other size is fixed by a guard: the symbols' values tell the sizes
            gm.meta[SIZES_GUARDED] = True
        return gm, [real for _, real in kept], [source for source, _ in kept]


class _OtherThreads(logging.Filter):
    """Passes the records of every thread but the one that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def fake_errors_unlogged():
    """Within the block, this thread's fake-tensor runs log nothing: torch logs each meta
    function that raises with its whole traceback, and capture turns such an error (a shape
    mismatch in the user's `x @ w`) into the user's own error, raised at their line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _OtherThreads()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# operations whose fake-tensor rules accept operands of different dtypes, which their kernels refuse:
# products (any two dtypes), and normalizations (float64 beside another: eager's CPU kernels take
# a bfloat16 or float16 input with float32 parameters, but nothing else mixed)
_MATMUL_NAMES = {"linear", "mm", "matmul", "__matmul__", "__rmatmul__", "addmm", "addmv", "mv", "dot", "vdot", "bilinear"}
_MATMUL_MODULES = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.RNNBase, torch.nn.MultiheadAttention)
_NORM_NAMES = {"batch_norm", "layer_norm", "group_norm", "instance_norm"}
_NORM_MODULES = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)


def _check_matmul_dtypes(target: object, root: torch.nn.Module, operands: list) -> None:
    """A product of tensors of different dtypes (float64 input, float32 weight) raises in eager;
    it must raise at the user's line (a break there), not from a graph past side effects."""
    what = _describe(target)
    if isinstance(target, str) and hasattr(root, target):  # call_module: its name
        module = getattr(root, target)
        if not isinstance(module, (*_MATMUL_MODULES, *_NORM_MODULES)):
            return
        norm = isinstance(module, _NORM_MODULES)
        operands, what = [*operands, *module.parameters()], _describe(module)
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name not in _MATMUL_NAMES and name not in _NORM_NAMES:
            return
        norm = name in _NORM_NAMES
    tensors = [t for t in pytree.tree_leaves(operands) if isinstance(t, torch.Tensor)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point() or not norm}  # a norm's int arguments: counts
    if len(dtypes) > 1 and (not norm or torch.float64 in dtypes or not all(d.is_floating_point for d in dtypes)):
        raise Unsupported(f"{what} of {' and '.join(sorted(map(str, dtypes)))} tensors "
                          "(the eager run raises: its operands must have one dtype)")


def _describe(target: object) -> str:
    if isinstance(target, str):
        return f"Tensor.{target}()"
    if isinstance(target, torch.nn.Module):
        return f"{type(target).__name__} module"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", repr(target))
    return f"{module}.{name}()" if module and module not in ("_operator", "builtins") else f"{name}()"




def _symbolic_dims(fake: torch.Tensor | None) -> tuple[int, ...]:
    if fake is None or fake.layout is not torch.strided:
        return ()
    return tuple(d for d, n in enumerate(fake.shape) if is_symbolic(n))


def _has_symbols(result: object) -> bool:
    if is_symbolic(result):
        return True
    if isinstance(result, torch.Tensor):
        return False
    if isinstance(result, (tuple, list)):
        return any(is_symbolic(x) for x in result)
    return False


def _module_state(source: Source) -> bool:
    """Whether `source` reads a module's registered parameter or buffer."""
    return isinstance(source, ModuleEntrySource) and source.store in ("_parameters", "_buffers")
