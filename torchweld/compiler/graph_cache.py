"""The graph cache: compiled graphs kept in the disk cache, so that a process compiling a
graph compiled before (a second run of a program, a restarted server, every rank of a job)
loads its generated code instead of tracing, lowering, scheduling and rendering it again.

    key = graph_key(gm, example_inputs, options, ...)    # None: this graph is not kept
    compiled = load(key, gm)                             # None on a miss
    ... compile ...
    store(key, assembly, out_spec)                       # the Assembly codegen made
    load_unbound(compiled.cache_key)                     # an entry that binds no module attribute

An entry is named by a hash of everything its code was made from: the graph's nodes (their
ops, targets and arguments), the leaf modules it calls (their class, settings and mode), the
layout of every input, parameter, buffer and tensor attribute (shape, strides, offset, dtype,
device, requires_grad, and which of them share storage), the options, the process state
tracing reads (default dtype, autocast, deterministic algorithms, matmul and attention
settings, the tuning constants), the versions of Python, torch and Triton, and the source of
torchweld itself. A graph holding anything whose meaning its name does not fix (a user's
function in the graph, a module class not torch's, a tensor subclass) is not kept. Values of
parameters and buffers are not part of the key: the wrapper reads them when it runs, and a
loaded entry binds them by their place in the module (`attr` recipes). A small tensor no
attribute holds is one the graph's own code made from literals in its nodes (a lifted
`torch.tensor([...])`): kept by value, its value follows from the key.

The entry (JSON, sealed by disk_cache: a truncated or altered one is deleted with a warning
and the graph compiled again) holds the wrapper's source with launch tokens
(wrapper.launch_token), the C++ source (its library is the disk cache's), the Triton modules
and each kernel's compile job, and a recipe for each object the wrapper names. Loading builds
the kernels' launchers anew (Triton's own cache has their binaries) and fills the tokens.
A graph compiled over symbolic sizes (backends/weld_symbolic.py) is keyed by its symbols
(the inputs' sizes as expressions of them, and each symbol's range), not by sizes; its entry
holds the guards its compile recorded, which a load checks at the call's sizes (an entry they
do not admit is compiled again, and replaced) and records in the new compile's ShapeEnv, so
the loaded graph assumes what the compiled one did. Not kept (compiled each time, as before):
graphs compiled with `freeze` (constants computed at compile time) or `max_autotune`
(choices timed on this machine). A training step's two graphs take the module's tensors as
inputs (no `attr` recipe): a training entry names them by key (autograd/training_cache.py) and
loads them without the graphs' text, over symbolic sizes too (the backward's entry, compiled
last, holds every guard of the step's compile: the trace's, the partition's and both graphs').
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import platform
import sys
import types

import sympy
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from torchweld import config, disk_cache, timing
from torchweld.compiler.aten_trace import CONSTANT_PREFIX
from torchweld.compiler.symbols import SizeText, compiling_env, is_symbol_size, size_text, symbol_values
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.cache")

_SMALL = 64  # elements: a tensor constant the graph's code made is kept by value up to this size

FORMAT = "torchweld-graph-1"
# modules whose callables mean the same thing in any process with the same versions
_STABLE_MODULES = ("torch", "torchweld", "operator", "math", "builtins", "_operator")


class NotKept(Exception):
    """The graph holds something its entry could not name (its reason says what)."""


@dataclasses.dataclass
class GraphKey:
    key: str
    tensor_paths: dict[int, str]  # id of each tensor the module holds -> its attribute path
    # a graph compiled over symbols (backends/weld_symbolic.py): the ShapeEnv of its compile,
    # whose guards its entry keeps and a load records again (_assumed_guards)
    env: object = None


def graph_key(gm: torch.fx.GraphModule, example_inputs: list, options: dict, traced: bool,
              output_strides: list | None, frees_inputs: bool, before_passes: bool = False) -> GraphKey | None:
    """The key of `gm`'s entry, or None where the graph is not kept (the reason goes to the
    `cache` log at debug level). `before_passes`: `gm` is the captured graph, which the
    torch-level passes (pipeline.FX_PASSES, with the options in the key) will rewrite; they add
    no attributes to it where the cache keeps graphs (not with freeze), so the entry's objects
    are found on the captured graph."""
    if not config.graph_cache:
        return None
    if options.get("freeze") or options.get("max_autotune"):
        log.debug("graph cache: graphs compiled with freeze or max_autotune are not kept")
        return None
    env = None
    if any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor) and any(map(is_symbol_size, (*x.shape,
                                                                                       *x.stride())))
           for x in example_inputs):
        env = compiling_env()
        if env is None:
            log.debug("graph cache: symbolic sizes outside a compile over them are not kept")
            return None
    try:
        with timing.phase("weld.graph_cache.key"):
            describer = _Describer()
            parts = [FORMAT, _versions(), _process_state(), _literal(dict(sorted(options.items()))), repr(traced),
                     _literal(output_strides), repr(frees_inputs), _passes(before_passes), describer.graph(gm),
                     describer.module_state(gm), describer.inputs(example_inputs), _symbol_ranges(env)]
            key = disk_cache.content_hash(*parts)
        if log.isEnabledFor(logging.DEBUG):  # which part differs, where two runs expected one entry
            names = ("format", "versions", "process state", "options", "traced", "output strides", "frees inputs",
                     "passes", "graph", "module state", "inputs", "symbols")
            log.debug("graph cache: key %s of %s", key,
                      ", ".join(f"{n} {disk_cache.content_hash(p)[:8]}" for n, p in zip(names, parts)))
        return GraphKey(key, describer.paths, env)
    except NotKept as e:
        log.debug("graph cache: this graph is not kept: %s", e)
        return None


def _passes(before_passes: bool) -> str:
    """The torch-level passes a graph keyed before them goes through, by name ("" for one after)."""
    if not before_passes:
        return ""
    from torchweld.compiler.pipeline import FX_PASSES

    return "passes " + " ".join(p.name for p in FX_PASSES)


def _symbol_ranges(env) -> str:
    """Each symbol of a compile over symbols with its range (what the compile may prove without a
    guard); the inputs' lines name which size each symbol is."""
    if env is None:
        return ""
    return "\n".join(f"{s} {env.var_to_range[s]}" for s in sorted(symbol_values(env), key=str))


def _entry_name(key: str) -> str:
    return f"g{key}.json"


# =============================================================================
# The key
# =============================================================================


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    """Python, torch, Triton and the machine, and a hash of torchweld's own source files."""
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # noqa: BLE001 - no Triton: no Triton kernels either
        triton = "-"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = []
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.endswith((".py", ".c")):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    files.append(f"{os.path.relpath(os.path.join(folder, name), root)}:{f.read()}")
    return disk_cache.content_hash(sys.version, torch.__version__, str(torch.version.cuda), triton,
                                   platform.machine(), *files)


def _process_state() -> str:
    """The settings tracing and lowering read from the process, as they are now."""
    backends = torch.backends
    state = [
        torch.get_default_dtype(),
        [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
        torch.is_autocast_cache_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
        backends.cudnn.enabled, backends.cudnn.allow_tf32, backends.cudnn.deterministic, backends.cudnn.benchmark,
        backends.cuda.matmul.allow_tf32, backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
        backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled(),
        config.size_generic_kernels, repr(tuning),
    ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state += [torch.cuda.get_device_name(i) + str(torch.cuda.get_device_capability(i))
                  for i in range(torch.cuda.device_count())]
    return repr(state)


def _literal(value) -> str:
    """`value` (an option, a node's argument) as stable text; NotKept for what has none."""
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return f"{type(value).__name__}:{value}"
    if isinstance(value, torch.Size):
        return f"Size{tuple(value)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(map(_literal, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_literal(value.start)}, {_literal(value.stop)}, {_literal(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # an aten graph's size over symbols
        return f"{type(value).__name__}:{value.node.expr}"
    if callable(value):
        return _callable_name(value)
    raise NotKept(f"an argument of type {type(value).__name__}")


def _callable_name(fn) -> str:
    """`module.qualname` of an operator or a function of torch, torchweld or Python's operator
    modules, which mean the same in any process of the same versions; NotKept for another."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{fn}"
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if module is None and isinstance(getattr(fn, "__self__", None), types.ModuleType):
        module = fn.__self__.__name__
    owner = getattr(fn, "__objclass__", None)  # a C method: torch.Tensor.add
    if module is None and owner is not None:
        module, name = owner.__module__, f"{owner.__qualname__}.{fn.__name__}"
    if not module or not name or module.split(".")[0] not in _STABLE_MODULES or "<" in name:
        raise NotKept(f"the graph calls {fn!r}, whose meaning its name does not fix")
    return f"{module}.{name}"


class _Describer:
    """Text for a graph's nodes, its modules' settings and tensors, and its inputs; it numbers
    storages across all of them, so that which tensors share memory is part of the key."""

    def __init__(self):
        self.storages: dict[tuple, int] = {}
        self.paths: dict[int, str] = {}

    def graph(self, gm: torch.fx.GraphModule) -> str:
        lines = []
        for node in gm.graph.nodes:
            target = _callable_name(node.target) if node.op == "call_function" else str(node.target)
            lines.append(f"{node.op} {node.name} {target} {_literal(node.args)} {_literal(dict(node.kwargs))}")
        return "\n".join(lines)

    def module_state(self, gm: torch.fx.GraphModule) -> str:
        """The class and settings of each submodule and the layout of each tensor it holds."""
        lines = []
        for path, module in gm.named_modules(remove_duplicate=False):
            if path and isinstance(module, torch.fx.GraphModule):  # a checkpointed block's graph
                lines.append(f"graph {path}\n{self.graph(module)}")
            elif path:  # the root is the graph itself
                cls = type(module)
                _callable_name(cls)  # a module class not torch's: its forward may change
                settings = {k: v for k, v in sorted(vars(module).items()) if not k.startswith("_")
                            and not isinstance(v, (torch.Tensor, torch.nn.Module))}
                lines.append(f"module {path} {cls.__module__}.{cls.__qualname__} {module.extra_repr()} "
                             f"{_literal(settings)}")
            for name, value in sorted(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    lines.append(self._tensor_line(f"{path}.{name}" if path else name, value))
            for kind in ("_parameters", "_buffers"):
                for name, value in module.__dict__.get(kind, {}).items():
                    if value is not None:
                        lines.append(self._tensor_line(f"{path}.{name}" if path else name, value))
        return "\n".join(lines)

    def inputs(self, example_inputs: list) -> str:
        lines = []
        for value in example_inputs:
            if isinstance(value, torch.Tensor):
                lines.append(self.tensor(value))
            elif isinstance(value, torch.SymInt):  # an int argument of a compile over symbols (graph_key)
                lines.append(f"symbolic int {value}")
            elif isinstance(value, (torch.SymFloat, torch.SymBool)):
                raise NotKept("a symbolic number among the inputs")
            else:
                lines.append(_literal(value))
        return "\n".join(lines)

    def _tensor_line(self, path: str, t: torch.Tensor) -> str:
        self.paths.setdefault(id(t), path)
        return f"tensor {path} {self.tensor(t)}"

    def tensor(self, t: torch.Tensor) -> str:
        # fake tensors: a training step's backward is compiled ahead on fakes of its inputs
        if type(t) not in (torch.Tensor, torch.nn.Parameter, FakeTensor) or t.layout != torch.strided:
            raise NotKept(f"a {type(t).__name__} with layout {t.layout}")
        try:
            storage = (str(t.device), t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError) as e:
            raise NotKept(f"a tensor without storage ({e})") from None
        group = self.storages.setdefault(storage, len(self.storages))
        return (f"{tuple(t.shape)} {t.stride()} {t.storage_offset()} {t.dtype} {t.device} {t.requires_grad} "
                f"{type(t).__name__} {t.is_conj()} {t.is_neg()} storage{group}")


# =============================================================================
# Storing an entry
# =============================================================================


def store(key: GraphKey, parts, out_spec) -> bool:
    """Write the entry of a graph just compiled (`parts`: its driver.Assembly), where every
    object its wrapper names has a recipe; say why not in the `cache` log otherwise. True
    where it was written and binds no module attribute (load_unbound can load it)."""
    try:
        with timing.phase("weld.graph_cache.store"):
            profiled, profiled_constants = parts.render_profiled()
            if any(name not in parts.constants for name in profiled_constants):
                raise NotKept("the profiled wrapper names constants the wrapper does not")
            entry = {
                "format": FORMAT,
                "template": parts.template,
                "profiled": profiled,
                "boxed": parts.boxed,
                "stream_index": parts.stream_index,
                "jit": parts.jit,
                "fast": {name: _fast_part(p, parts.triton_functions[name]) for name, p in parts.fast_parts.items()},
                "cpp": {"source": parts.sources["cpp"], "kernels": parts.cpp_kernels} if parts.cpp_kernels else None,
                "triton_modules": parts.triton_modules,
                "triton_functions": parts.triton_functions,
                "constants": {name: _recipe(value, parts.origins.get(name), key.tensor_paths,
                                            written=name in parts.written_constants)
                              for name, value in parts.constants.items()},
                "out_spec": pytree.treespec_dumps(out_spec),
                "input_names": parts.input_names,
                "writes": parts.writes,
                "written_constants": parts.written_constants,
                "read_inputs": sorted(parts.read_inputs),
                "externs": parts.externs,
            }
            if key.env is not None:  # what the compile assumed of the symbols, for a load to assume again
                entry["guards"] = [str(g.expr) for g in key.env.guards]
            disk_cache.write_sealed("graphs", _entry_name(key.key), key.key, json.dumps(entry).encode())
        log.debug("graph cache: stored %s", key.key)
        return not _binds_attributes(entry)
    except NotKept as e:
        log.debug("graph cache: this graph is not kept: %s", e)
    except OSError as e:
        log.warning("torchweld: cannot write a graph cache entry (%s); the graph is compiled each time", e)
    except (TypeError, ValueError) as e:  # a value JSON cannot hold: our bug, not the compile's failure
        log.warning("torchweld: a graph cache entry holds a value it cannot write (%s: %s); the graph is "
                    "compiled each time", type(e).__name__, e)
    return False


def _binds_attributes(entry: dict) -> bool:
    return any(recipe[0] == "attr" for recipe in entry["constants"].values())


def _fast_part(part, function: str) -> dict:
    job = part.job
    return {"grid": _size_entry(part.grid), "args": list(part.args), "ints": list(map(_size_entry, part.ints)),
            "function": function,
            "arg_dtypes": [str(d).removeprefix("torch.") for d in job.arg_dtypes], "aligned": list(job.aligned),
            "config": [list(c) for c in job.config], "device": str(job.device), "classes": list(job.ints),
            "params": list(job.params), "unspecialized": list(job.unspecialized)}


def _size_entry(n: object) -> object:
    """A launch's grid or int argument in an entry: an int, or over symbols the Python the
    wrapper computes it with (`size_text`), {"text": ...}."""
    return {"text": size_text(n)} if is_symbol_size(n) else n


def _size_from(entry: object) -> object:
    return SizeText(entry["text"]) if isinstance(entry, dict) else entry


def _callable_recipe(fn):
    """An operator's or function's name, or for a callable dataclass of torchweld's (an op
    wrapped: lowering's _NonTensorsAsEmpty) its class's name and each field's recipe."""
    if dataclasses.is_dataclass(fn) and not isinstance(fn, type):
        return {"class": _callable_name(type(fn)),
                "fields": {f.name: _callable_recipe(getattr(fn, f.name)) for f in dataclasses.fields(fn)}}
    return _callable_name(fn)


def _callable_from(recipe):
    if isinstance(recipe, dict):
        return _resolve(recipe["class"])(**{name: _callable_from(r) for name, r in recipe["fields"].items()})
    return _resolve(recipe)


def _by_value(t: torch.Tensor) -> list:
    return ["value", str(t.dtype).removeprefix("torch."), str(t.device), list(t.shape), list(t.stride()),
            t.detach().cpu().flatten().tolist()]


def _recipe(value, origin, tensor_paths: dict[int, str], written: bool = False) -> list:
    """How to make `value`, an object a wrapper names, in another process."""
    if origin is not None:  # an extern's callable, made from an operator or a function
        return ["extern", _callable_recipe(origin)]
    if isinstance(value, torch.Tensor):
        plain = type(value) is torch.Tensor and value.layout == torch.strided
        path = tensor_paths.get(id(value))
        if plain and value.numel() == 0 and not written and (path is None or path.startswith(CONSTANT_PREFIX)):
            # an empty constant the trace made: its layout (in the key) is all there is to it, so a
            # traced training graph holding one binds no attribute (a module's own empty tensor
            # stays bound: the graph may return that very object)
            return _by_value(value)
        if path is not None:
            return ["attr", path]
        # Any other real tensor the trace saw was made by the graph's own code from what the key
        # holds (`torch.tensor([2.0, 1.0])`'s literal, lifted): its value follows from the key.
        if plain and value.numel() <= _SMALL:
            return _by_value(value)
        raise NotKept("a large tensor constant no attribute of the module holds")
    if isinstance(value, torch.device):
        return ["device", str(value)]
    if isinstance(value, list) and not value:
        return ["list"]
    if isinstance(value, (torch.memory_format, torch.layout)):
        name = str(value).removeprefix("torch.")
        if getattr(torch, name, None) is value:
            return ["torch", name]
    raise NotKept(f"the wrapper names a {type(value).__name__}")


# =============================================================================
# Loading an entry
# =============================================================================


def load(key: GraphKey, gm: torch.fx.GraphModule | None):
    """The driver.CompiledGraph of `key`'s entry, bound to `gm`'s tensors; None where there
    is none, or it cannot be used (a warning says why, and the graph is compiled again)."""
    data = disk_cache.read_sealed("graphs", _entry_name(key.key), key.key)
    if data is None:
        return None
    try:
        with timing.phase("weld.graph_cache.load"):
            entry = json.loads(data)
            guards = _assumed_guards(entry, key.env)
            if guards is None:
                return None
            compiled = _assemble(entry, gm)
            for guard in guards:  # recorded in this compile's ShapeEnv: the compiled graph checks them
                key.env.evaluate_expr(guard)
        compiled.cache_key = None if _binds_attributes(entry) else key.key
        log.debug("graph cache: loaded %s", key.key)
        return compiled
    except Exception as e:  # noqa: BLE001 - an entry this torchweld cannot use is compiled again
        log.warning("torchweld: the graph cache entry %s cannot be used (%s: %s); compiling the graph again",
                    _entry_name(key.key), type(e).__name__, e)
        return None


def _assumed_guards(entry: dict, env) -> list | None:
    """The guards an entry compiled over symbols assumed, as expressions over `env`'s symbols;
    None where one does not hold at this call's sizes (compiled again, for them: the entry is
    overwritten). [] for an entry of static sizes."""
    if env is None:
        if entry.get("guards"):  # (an entry over symbols, named by key outside a compile over them)
            log.debug("graph cache: an entry over symbols outside a compile over them: compiled again")
            return None
        return []
    from torch.utils._sympy import functions

    names = {k: v for k, v in vars(functions).items() if isinstance(v, type)}
    names |= {str(s): s for s in symbol_values(env)}
    guards = [sympy.sympify(text, locals=names) for text in entry.get("guards", ())]
    values = {s: sympy.Integer(v) for s, v in symbol_values(env).items()}
    for guard in guards:
        if guard.xreplace(values) is not sympy.true:
            log.debug("graph cache: the entry assumed %s, which this call's sizes do not meet: compiled again", guard)
            return None
    return guards


def load_unbound(key: str):
    """The driver.CompiledGraph of the entry `key` names (a CompiledGraph's cache_key), which
    binds no module attribute; None where there is none or it cannot be used (a warning then).
    Inside a compile over symbols, its guards are checked and recorded in that compile's
    ShapeEnv, as `load` does with a key's."""
    return load(GraphKey(key, {}, compiling_env()), None)


def _assemble(entry: dict, gm: torch.fx.GraphModule | None):
    from torchweld.compiler.driver import Assembly, assemble

    if entry.get("format") != FORMAT:
        raise ValueError(f"its format is {entry.get('format')!r}, not {FORMAT!r}")
    constants = {name: _make(recipe, gm) for name, recipe in entry["constants"].items()}
    kernel_objects, sources, paths = {}, {}, {}
    if entry["cpp"] is not None:
        from torchweld.runtime.cpp_loader import load_kernels

        cpp = entry["cpp"]
        n_args = {name: tuple(counts) for name, counts in cpp["kernels"].items()}
        fns, paths["cpp"] = load_kernels(cpp["source"], list(n_args), n_args)
        sources["cpp"] = cpp["source"]
        kernel_objects |= {f"_k_{name}": fn for name, fn in fns.items()}
    fast: dict[str, str] = {}
    if entry["triton_modules"]:
        fast = _triton_kernels(entry, kernel_objects, sources, paths)
    profiled = entry["profiled"]
    parts = Assembly(
        entry["template"], lambda: (profiled, constants), entry["jit"], fast, constants, kernel_objects,
        entry["stream_index"], entry["boxed"], sources, paths, entry["input_names"], entry["writes"],
        entry["written_constants"], frozenset(entry["read_inputs"]), entry["externs"])
    return assemble(parts, pytree.treespec_loads(entry["out_spec"]))


def _triton_kernels(entry: dict, kernel_objects: dict, sources: dict, paths: dict) -> dict[str, str]:
    """Load the entry's Triton modules into `kernel_objects` (the JIT functions), and build the
    launchers of its fast lines (from Triton's cache, which compiled them before); the fast
    lines, or none where they cannot be had (the JIT lines run then)."""
    from torchweld.compiler.codegen.triton_launches import fast_launch
    from torchweld.runtime import triton_launch
    from torchweld.runtime.triton_loader import GeneratedKernel

    loaded = {fn: GeneratedKernel(src, fn) for fn, src in entry["triton_modules"].items()}
    for k in loaded.values():
        k.written.result()
    sources["triton"] = "\n".join(k.src for k in loaded.values())
    paths["triton"] = [k.path for k in loaded.values()]
    for kernel, fn in entry["triton_functions"].items():
        kernel_objects[f"_k_{kernel}"] = loaded[fn]
    parts = entry["fast"]
    if not parts:
        return {}
    jobs = [triton_launch.CompileJob(
        loaded[p["function"]].src, loaded[p["function"]], tuple(getattr(torch, d) for d in p["arg_dtypes"]),
        tuple(p["aligned"]), tuple(tuple(c) for c in p["config"]), torch.device(p["device"]), tuple(p["classes"]),
        tuple(p["params"]), tuple(p["unspecialized"])) for p in parts.values()]
    with timing.phase("weld.triton_compile"):
        handles = triton_launch.compile_kernels(jobs)
    return {name: fast_launch(name, _size_from(p["grid"]), p["args"], tuple(map(_size_from, p["ints"])), handle,
                              kernel_objects)
            for (name, p), handle in zip(parts.items(), handles)}


def _make(recipe: list, gm: torch.fx.GraphModule | None):
    kind, *rest = recipe
    if kind == "attr":
        if gm is None:
            raise ValueError(f"it binds the module attribute {rest[0]}, and no module was given")
        value = gm
        for part in rest[0].split("."):
            value = getattr(value, part)
        return value
    if kind == "value":
        dtype, device, shape, stride, values = rest
        flat = torch.tensor(values, dtype=getattr(torch, dtype), device=device)
        return torch.empty_strided(shape, stride, dtype=flat.dtype, device=device).copy_(flat.reshape(shape))
    if kind == "device":
        return torch.device(rest[0])
    if kind == "list":
        return []
    if kind == "torch":
        return getattr(torch, rest[0])
    if kind == "extern":
        from torchweld.compiler.codegen.bindings import fast_callable

        return fast_callable(_callable_from(rest[0]))
    raise ValueError(f"an unknown recipe {kind!r}")


def _register_own_operators() -> None:
    """Import torchweld.runtime's modules: importing one registers the operators it defines
    (torch.ops.torchweld.embedding_dense_backward), which a new process has not met yet."""
    import pkgutil

    from torchweld import runtime

    for module in pkgutil.iter_modules(runtime.__path__):
        try:
            importlib.import_module(f"torchweld.runtime.{module.name}")
        except ImportError:  # one that needs Triton, here without it: it defines no operator
            pass


def _resolve(name: str):
    """The operator or function `_callable_name` named."""
    if name.startswith("op:"):
        namespace, op, overload = name[len("op:"):].split(".")
        if namespace == "torchweld" and not hasattr(torch.ops.torchweld, op):
            _register_own_operators()
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:  # the qualname: a function, or Class.method
            value = getattr(value, part)
        return value
    raise ImportError(f"no module of {name}")
