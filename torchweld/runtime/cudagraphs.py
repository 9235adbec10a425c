"""Run a compiled callable as CUDA graphs: warm it up once, record it, then replay.

    fast = CudaGraphed(fn, pool=CudaGraphPool(CudaGraphRecorder()))
    fast(*inputs)   # 1st call per input layout: warm-up run, recording, first replay
    fast(*inputs)   # later calls: copy inputs into static buffers, replay, hand out outputs

Any callable that takes tensors positionally and returns a pytree of tensors can
go through `CudaGraphed`: the weld forward, the `cudagraphs` backend's eager
graph, or a compiled backward. To record one from elsewhere (compiled training):

    from torchweld.runtime.cudagraphs import CudaGraphed, pool_for
    pool = pool_for(options)                      # one pool per compiled model
    fwd = CudaGraphed(compiled_fwd, pool=pool, name="forward",
                      static_input_indices=param_positions,   # read in place
                      outputs="track")                        # saved activations: no copy
    bwd = CudaGraphed(compiled_bwd, pool=pool, name="backward")

Inputs. A graph is recorded per input layout (shape, stride, dtype, device of
each tensor, value of each non-tensor): a new layout is a new graph. Inputs at
`static_input_indices` (and every `nn.Parameter`) are read in place, by address:
a replay needs them at the addresses they had when it was recorded, so a call
whose static inputs lie elsewhere replays the recording made for those addresses
or records one (a replaced parameter; a compiled backward reading the activations
that one of several forward recordings saved). No reference to them is kept.
So are the tensors that, at the first call, lie in an output another recording
handed out (outputs="track" below): those stay put from replay to replay, as a
compiled step's gradients do between its backward's graph and its optimizer's.
Every other tensor is copied into a static buffer before each replay, and inputs
the callable mutates (`mutated_input_indices`) are copied back after it.
`guarded=True` says the capture's guards check every tensor argument's layout
before each call, so the adopted inputs need no place in the layout key either.

Outputs. A replay overwrites the tensors the previous replay produced, so:
  - outputs="copy" (the default) hands out a fresh copy of each output: always
    valid, costs one device copy per output;
  - outputs="track" hands out the static outputs themselves and counts the
    references to their storage; if any output of the last replay is still
    alive when the graph must run again, a further copy of the graph is
    recorded (into a pool of its own, see Memory) and replayed instead; past
    `max_instances` copies per layout it falls back to copying;
  - with outputs="track", `lent_from=k` hands out the outputs from position k on
    as the static tensors themselves, lent rather than aliased, for a caller that
    passes them on only to something whose lifetime it knows (compiled training
    saves them for its backward). A call then returns `(result, lease)`: the lent
    outputs are the caller's while it holds `lease` (a tiny tensor), and a replay
    that finds a lease still held records a further copy, as for a held output.
    densenet121's training forward hands out ~850 outputs, one of them the user's:
    lent, the others cost no tensor and no use count a replay. `lease` is None
    where the outputs are not a recording's (the graph ran without CUDA graphs,
    or copied its outputs out).

Memory. The graphs of one compiled model that copy their outputs out record into
one pool (`CudaGraphPool`). That is safe in any replay order: every static output
stays referenced by its graph, and a later recording may place its own outputs
and scratch only in memory that an earlier one used as scratch, which that earlier
graph's replays rewrite; whatever a replay writes there is copied out before
another graph runs. Outputs handed out as they are ("track") must outlive other
graphs' replays (the loss the user holds, the activations the backward reads), so
each tracked recording gets a pool of its own, where no other graph's scratch lies.

A graph with symbolic sizes is recorded once per concrete layout, as any graph is (more
than tuning.max_layouts of them run without CUDA graphs). What cannot be recorded (CPU tensors,
ops that synchronize with the host, a failure while recording) runs without CUDA graphs; the reason
is logged once per compiled model on the "torchweld.weld" logger at INFO.

The recording itself sits behind `GraphRecorder`, so that everything above can
be tested on the CPU with a fake recorder (tests/runtime/fake_recorder.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import weakref
from typing import Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree

from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")

OUTPUT_POLICIES = ("copy", "track")

# Ops whose result needs the host to wait for the device, or whose output size
# depends on data: a stream being recorded cannot contain them.
SYNCHRONIZING = frozenset({
    "item", "tolist", "numpy", "cpu", "nonzero", "nonzero_static", "unique", "_unique2", "unique_consecutive",
    "masked_select", "_local_scalar_dense", "argwhere", "repeat_interleave", "bincount", "histc",
    "equal", "is_nonzero", "allclose", "_assert_async", "synchronize",
})


# =============================================================================
# The recorder interface and its CUDA implementation
# =============================================================================


class GraphRecorder(Protocol):
    """How graphs are made; `CudaGraphRecorder` on a GPU, a fake in CPU tests."""

    device_type: str  # tensors on other devices cannot be recorded
    # True: a replay reads its static inputs by address (a CUDA graph); False: it runs the
    # function again (a fake), on the arguments CudaGraphed binds around each replay
    replays_by_address: bool

    def new_pool(self) -> object:
        """A memory pool handle that several recordings can share."""

    def warm_up(self, fn: Callable[[], object], device: torch.device | None) -> object:
        """Run `fn` once, outside any recording (lazy init, kernel compiles), and return its result."""

    def record(self, fn: Callable[[], object], pool: object,
               device: torch.device | None) -> tuple[Callable[[], None], object]:
        """Record `fn` into `pool`; return (replay, fn's result as static tensors a replay rewrites)."""


class CudaGraphRecorder:
    """torch.cuda.CUDAGraph: warm-ups and recordings on one side stream per device, into the pool given."""

    device_type = "cuda"
    replays_by_address = True

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def _side_stream(device: torch.device | None) -> torch.cuda.Stream:
        """The one stream of `device` that every warm-up and recording runs on."""
        index = torch.cuda.current_device() if device is None or device.index is None else device.index
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
        return stream

    def warm_up(self, fn: Callable[[], object], device: torch.device | None) -> object:
        with torch.cuda.device(device), _no_cublas_workspaces():
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = fn()
            torch.cuda.current_stream().wait_stream(stream)
        return out

    def record(self, fn: Callable[[], object], pool: object,
               device: torch.device | None) -> tuple[Callable[[], None], object]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: weld's own threads go on meanwhile (a backward compiled ahead allocates
        # its kernels' dummy arguments and loads binaries), and in the default "global" mode
        # such a call from another thread invalidated this recording, which was then made again
        with torch.cuda.device(device), _no_cublas_workspaces(), \
                torch.cuda.graph(graph, pool=pool, stream=self._side_stream(device),
                                 capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


@contextlib.contextmanager
def _no_cublas_workspaces():
    """cuBLAS's workspaces (32 MiB a stream on the H100) let go of before and after a warm-up
    or recording, as torch.compile's CUDA graph trees do. cuBLAS allocates one for a stream
    at its first matrix multiply there and keeps it: kept from the side stream's first use on,
    it was alive at every later warm-up's and recording's peak (resnet50's inference: 33 MiB
    of its 388, the first matrix multiply its last layer, long after the peak). Let go of,
    the warm-up allocates it at that first matrix multiply and frees it after, and a recording
    allocates it in its own pool, where the graph keeps it as it keeps its scratch: freed
    there after the recording, so that a later recording into the pool may use it too, as
    scratch or outputs (see "Memory" above). Held from the side stream's creation on, it also
    pinned whatever segment it landed in."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None) or (lambda: None)  # a CPU-only torch has none
    clear()
    try:
        yield
    finally:
        clear()


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> CudaGraphRecorder._side_stream


class CannotRecord(Exception):
    """This call cannot be recorded; `str(e)` says why."""


@dataclasses.dataclass(eq=False)
class CudaGraphPool:
    """The memory pool the graphs of one compiled model share, plus the
    fallback reasons already logged for that model (each is logged once)."""

    recorder: GraphRecorder
    handle: object = None
    graphs_recorded: int = 0
    callables: int = 0  # CudaGraphed made on this pool, to name them in logs
    logged: set = dataclasses.field(default_factory=set)

    def next_name(self, kind: str) -> str:
        self.callables += 1
        return f"{kind} #{self.callables}"

    def pool(self) -> object:
        if self.handle is None:
            self.handle = self.recorder.new_pool()
        return self.handle

    def log_fallback(self, name: str, reason: str) -> None:
        if reason not in self.logged:
            self.logged.add(reason)
            log.info("%s runs without CUDA graphs: %s", name, reason)


def pool_for(options: dict, recorder: GraphRecorder | None = None) -> CudaGraphPool:
    """The pool of the compiled model whose backend received `options`.

    A user may put their own `CudaGraphPool` under "cudagraph_pool" to share one pool
    between models. Otherwise `torchweld.compile` hands every backend call of one compiled
    model the same `backends.BackendOptions`, and the pool is kept in its `shared` (never in
    the user's dict). A plain dict (a backend called directly) gets a pool of its own."""
    pool = options.get("cudagraph_pool")
    if pool is not None:
        return pool
    shared = getattr(options, "shared", None)
    if shared is None:
        return CudaGraphPool(recorder or CudaGraphRecorder())
    pool = shared.get("cudagraph_pool")
    if pool is None:
        pool = shared["cudagraph_pool"] = CudaGraphPool(recorder or CudaGraphRecorder())
    return pool


# =============================================================================
# Why a graph cannot be recorded
# =============================================================================


def input_reason(args: Sequence[object], device_type: str = "cuda") -> str | None:
    """Why calls with `args` cannot be recorded, or None."""
    devices = set()
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.device.type != device_type:
                return f"input {i} is a {a.device.type.upper()} tensor"
            devices.add(a.device)
        elif isinstance(a, (torch.SymInt, torch.SymFloat)):
            return f"input {i} is a symbolic size (dynamic sizes)"
    if len(devices) > 1:
        return f"inputs are on several devices ({', '.join(sorted(map(str, devices)))})"
    return None


def graph_reason(gm: torch.fx.GraphModule, device_type: str = "cuda") -> str | None:
    """Why the FX graph `gm` cannot be recorded (CPU tensors it owns, ops that synchronize), or None."""
    for name, t in [*gm.named_parameters(), *gm.named_buffers(),
                    *((k, v) for k, v in gm.__dict__.items() if isinstance(v, torch.Tensor))]:
        if t.device.type != device_type and t.numel() > 1:  # a 0-d/1-element constant is fine: it is a scalar
            return f"{name} is a {t.device.type.upper()} tensor"
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            target = call_name(node)
            if target in SYNCHRONIZING and _synchronizes(node, target):
                where = _user_location(node)
                return f"{target}() synchronizes with the host or has a data-dependent size{where}"
    return None  # symbolic sizes are no reason: each concrete layout is recorded (up to tuning.max_layouts)


def _synchronizes(node: torch.fx.Node, target: str) -> bool:
    """Whether a call of a SYNCHRONIZING name does: `repeat_interleave` does only with its
    repeats a tensor and no output_size (an int repeats is an expand and a copy: a KV cache's
    grouped-query heads)."""
    if target != "repeat_interleave":
        return True
    if node.kwargs.get("output_size") is not None:
        return False
    repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else node.args[0] if node.args else None)
    if repeats is None or isinstance(repeats, torch.fx.Node):
        example = repeats.meta.get("example_value") if isinstance(repeats, torch.fx.Node) else None
        return not isinstance(example, (int, torch.SymInt))
    return False


def call_name(node: torch.fx.Node) -> str:
    """The bare name of what a call_function / call_method node calls ("add_", "detach",
    "item": an aten overload's packet name too), or "" for any other node."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "").split(".")[0]
    return ""


def _user_location(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return f" ({lines[-1]})" if lines else ""


def resident_placeholders(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of placeholders the capture marked resident (`meta["static_address"]`):
    the same tensor object at every call, by its guards (an optimizer's state). A replay
    reads them in place, as it reads parameters, instead of copying them in (and back)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if n.meta.get("static_address")]


def mutated_placeholders(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of placeholders that an in-place op may write (through views too); conservative."""
    view_like = {"view", "reshape", "getitem", "transpose", "t", "permute", "select", "narrow", "unsqueeze",
                 "squeeze", "expand", "as_strided", "flatten", "unflatten", "view_as", "split", "chunk",
                 "unbind", "detach", "__getitem__", "contiguous", "movedim", "diagonal", "real", "imag"}
    roots: dict[torch.fx.Node, set[int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        roots[n] = {i}
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        first = node.args[0] if node.args else None
        firsts = first if isinstance(first, (list, tuple)) else [first]  # a foreach op writes a list
        src = set().union(*(roots.get(f, set()) for f in firsts if isinstance(f, torch.fx.Node)))
        if node.op == "call_module":
            name, inplace = "", getattr(gm.get_submodule(node.target), "inplace", False)
        else:
            name = call_name(node)
            inplace = (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs \
                or node.kwargs.get("inplace") is True or name.startswith("__i")
        if inplace:
            mutated |= src
        if name in view_like or inplace:
            roots[node] = src
    return sorted(mutated)


# =============================================================================
# Recording and replaying
# =============================================================================


@dataclasses.dataclass(eq=False)
class _Instance:
    """One recorded graph: its static inputs, static outputs and replay.

    A replay of densenet121's training forward reads ~730 inputs in place and hands out
    ~850 outputs, its backward ~680 and ~360: what a replay does per tensor is kept to a
    C-level `map` over lists worked out here, at recording."""

    replay: Callable[[], None]
    inputs: list  # static buffers the inputs are copied into (None: not a tensor, or read in place)
    copied: list[int]  # positions of the inputs copied into `inputs` before each replay
    outputs: list  # flat static outputs
    in_place: Callable[[tuple], tuple]  # the inputs read in place, picked out of a call's arguments
    in_place_ptrs: list[int]  # their data_ptr when recorded
    # "track": the storages of the outputs handed out (and of the lease), whose use counts
    # say who holds them; None: outputs are copied out
    storages: list | None
    storage_handles: list[int]  # their `_cdata`, what torch._C._storage_Use_Count reads
    baseline_uses: list[int]  # each one's use count right after recording
    lease: torch.Tensor | None  # with lent outputs: an alias of this is handed out with them
    rebuild: Callable[[list], object]  # flat outputs -> the callable's result
    # The arguments the recorded function sees; set only around a replay, and only for
    # recorders that run the function again (GraphRecorder.replays_by_address is False).
    bound: list
    # (output position, input position, size, stride, storage offset) of each output that is a
    # view of an adopted input (CudaGraphed._adopt), made from the call's argument at each
    # replay: kept here, it would count as a use of the other recording's output for good
    input_views: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Layout:
    """The graphs recorded for one input layout."""

    instances: list
    recordings: int = 1
    replays: int = 0


_EAGER = object()  # a layout that runs without CUDA graphs


class CudaGraphed:
    """`fn` run through CUDA graphs, one recording per input layout; see the module docstring."""

    def __init__(self, fn: Callable, *, pool: CudaGraphPool, name: str = "graph",
                 static_input_indices: Sequence[int] = (), mutated_input_indices: Sequence[int] = (),
                 outputs: str = "copy", max_instances: int = 4, graph_reason: str | None = None,
                 before_replay: Callable[[], None] | None = None, lent_from: int | None = None,
                 guarded: bool = False):
        if outputs not in OUTPUT_POLICIES:
            raise ValueError(f"outputs must be one of {OUTPUT_POLICIES}, got {outputs!r}")
        if lent_from is not None and outputs != "track":
            raise ValueError("lent_from needs outputs='track'")
        self.fn = fn
        self.pool = pool
        self.name = name
        self.static_input_indices = frozenset(static_input_indices)
        # inputs that were outputs another recording handed out, at the first call: read in
        # place too (_adopt); `guarded`: the capture's guards check every tensor argument's
        # layout before a call, so these need no place in the layout key either
        self.adopted: frozenset[int] = frozenset()
        self.guarded = guarded
        self.mutated_input_indices = tuple(mutated_input_indices)
        self.outputs = outputs
        self.lent_from = lent_from
        self.max_instances = max_instances
        self.graph_reason = graph_reason  # known up front (from the FX graph): never record
        # Python work a replay skips but must still do (weld's refresh of folded constants)
        self.before_replay = before_replay
        self.layouts: dict[tuple, object] = {}
        self.replays = 0
        self._keyed_by_count: dict[int, tuple[int, ...]] = {}

    def _keyed(self, count: int) -> tuple[int, ...]:
        """Positions of a call's `count` arguments that select its recording (not the static ones)."""
        keyed = self._keyed_by_count.get(count)
        if keyed is None:
            unkeyed = self.static_input_indices | (self.adopted if self.guarded else frozenset())
            keyed = self._keyed_by_count[count] = tuple(i for i in range(count) if i not in unkeyed)
        return keyed

    def _adopt(self, args: tuple) -> bool:
        """Read in place every tensor argument of this first call that lies in an output a
        recording handed out (`_HANDED_OUT`), instead of copying it in before each replay:
        such an output stays where it is from replay to replay. A compiled train step's
        optimizer graph reads the gradients its backward's recording handed out (densenet121:
        364 copies a step otherwise). Where one later lies elsewhere, `_moved` sees it."""
        adopted = frozenset(i for i, a in enumerate(args)
                            if isinstance(a, torch.Tensor) and i not in self.static_input_indices
                            and _handed_out(a))
        if adopted:
            log.debug("%s reads %d inputs in place: outputs of other recordings", self.name, len(adopted))
            self.adopted = adopted
            self._keyed_by_count.clear()
        return bool(adopted)

    # -- the call ----------------------------------------------------------------
    def __call__(self, *args):
        if self.graph_reason is not None:
            self.pool.log_fallback(self.name, self.graph_reason)
            return self._unrecorded(self.fn(*args))
        key = _layout_key(args, self._keyed(len(args)))
        entry = self.layouts.get(key)
        if entry is None:
            return self._first_call(key, args)
        if entry is _EAGER:
            return self._unrecorded(self.fn(*args))
        return self._replay(entry, args)

    def _unrecorded(self, result):
        """A result computed outside any recording, as a replay would return it."""
        return result if self.lent_from is None else (result, None)

    def _first_call(self, key: tuple, args: tuple):
        if not self.layouts and self._adopt(args):
            key = _layout_key(args, self._keyed(len(args)))  # the adopted inputs may leave the key
        reason = input_reason(args, self.pool.recorder.device_type)
        if reason is None and len(self.layouts) >= tuning.max_layouts:
            reason = f"more than {tuning.max_layouts} input layouts (dynamic sizes)"
        if reason is not None:
            self._run_eagerly(key, reason)
            return self._unrecorded(self.fn(*args))
        result = self.pool.recorder.warm_up(lambda: self.fn(*args), _device_of(args))
        kept = bool(self.mutated_input_indices)  # then a second run would repeat its writes
        if not kept:
            # The call's result is the first replay's (below), so the warm-up's is dropped
            # before recording: held, it would sit beside the recording's own outputs
            # (densenet121's training forward held its 453 MiB of saved activations twice).
            result = None
        try:
            instance = self._record(args, track=self.outputs == "track")
        except CannotRecord as e:
            self._run_eagerly(key, str(e))
            return self._unrecorded(result if kept else self.fn(*args))
        self.layouts[key] = _Layout([instance])
        if kept:  # the warm-up did the call's writes: a replay would repeat them
            return self._unrecorded(result)
        # Replayed at once, so that even the first call's outputs are the recording's: a
        # compiled backward recorded next reads those saved activations where later
        # replays will have them (the warm-up's results lay elsewhere).
        return self._replay(self.layouts[key], args)

    def _run_eagerly(self, key: tuple, reason: str) -> None:
        self.layouts[key] = _EAGER
        self.pool.log_fallback(self.name, reason)

    def _replay(self, entry: _Layout, args: tuple):
        try:
            instance = self._pick_instance(entry, args)
        except CannotRecord as e:
            self._run_eagerly(_layout_key(args, self._keyed(len(args))), str(e))
            return self._unrecorded(self.fn(*args))
        for i in instance.copied:
            static, arg = instance.inputs[i], args[i]
            if static is not arg:
                static.copy_(arg)
        if self.before_replay is not None:
            self.before_replay()
        if self.pool.recorder.replays_by_address:
            instance.replay()
        else:
            instance.bound[0] = [arg if static is None else static for static, arg in zip(instance.inputs, args)]
            instance.replay()
            instance.bound[0] = None
        self.replays += 1
        entry.replays += 1
        for i in self.mutated_input_indices:
            if i < len(args) and instance.inputs[i] is not None:
                args[i].copy_(instance.inputs[i])
        outputs = instance.outputs if not instance.input_views else _with_input_views(instance, args)
        if instance.storages is None:  # "copy", or "track" past max_instances
            flat = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
            return self._unrecorded(instance.rebuild(flat))
        # fresh aliases: each adds a use of the storage while the user holds it
        handed = outputs if self.lent_from is None else outputs[:self.lent_from]
        flat = [o.detach() if isinstance(o, torch.Tensor) else o for o in handed]
        if self.lent_from is None:
            return instance.rebuild(flat)
        return instance.rebuild(flat + outputs[self.lent_from:]), instance.lease.detach()

    def _pick_instance(self, entry: _Layout, args: tuple) -> _Instance:
        """A recording this call can replay: its static inputs where `args` has them and,
        for tracked outputs, none of its outputs still held; else a new recording."""
        matching = [inst for inst in entry.instances if not _moved(inst, args)]
        if self.outputs == "copy":
            return matching[0] if matching else self._add(entry, args, track=False)
        tracked = [inst for inst in matching if inst.storages is not None]
        for inst in tracked:
            if not _outputs_alive(inst):
                return inst
        if len(tracked) < self.max_instances:
            return self._add(entry, args, track=True)
        # the user holds outputs of every copy: copy out from now on
        log.debug("%s: outputs of %d recordings are all alive; copying outputs", self.name, len(tracked))
        copying = [inst for inst in matching if inst.storages is None]
        return copying[0] if copying else self._add(entry, args, track=False)

    def _add(self, entry: _Layout, args: tuple, track: bool) -> _Instance:
        """Record once more for this layout. Recordings whose static inputs lie elsewhere
        (a replaced parameter) are dropped once more than 2 * max_instances are kept;
        static inputs that move at nearly every call make the layout run without graphs."""
        if entry.recordings >= 4 * self.max_instances and entry.recordings > entry.replays // 2:
            raise CannotRecord("its static inputs (parameters, saved activations) move between calls")
        instance = self._record(args, track=track)
        entry.recordings += 1
        entry.instances.append(instance)
        while len(entry.instances) > 2 * self.max_instances:
            stale = next((inst for inst in entry.instances if _moved(inst, args)), entry.instances[0])
            entry.instances.remove(stale)
        return instance

    # -- recording -----------------------------------------------------------------
    def _record(self, args: tuple, track: bool) -> _Instance:
        in_place = []
        inputs = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                inputs.append(None)
            elif i in self.static_input_indices or i in self.adopted or isinstance(a, torch.nn.Parameter):
                inputs.append(a)
                in_place.append(i)
            else:
                buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                inputs.append(buf)
        static_args = [s if s is not None else a for s, a in zip(inputs, args)]
        if any(isinstance(a, torch.Tensor) and a.data_ptr() % 16 != s.data_ptr() % 16 for a, s in zip(args, static_args)):
            # Triton specializes kernels on 16-byte pointer alignment: compile the static
            # buffers' variant now, since nothing may compile while a stream records
            self.pool.recorder.warm_up(lambda: self.fn(*static_args), _device_of(args))
        spec_box, bound = [], [static_args]

        def run():
            flat, spec = pytree.tree_flatten(self.fn(*bound[0]))
            spec_box.append(spec)
            return flat

        pool = self.pool.recorder.new_pool() if track else self.pool.pool()  # see "Memory" above
        try:
            replay, outputs = self.pool.recorder.record(run, pool, _device_of(args))
        except CannotRecord:
            raise
        except RuntimeError as e:  # e.g. "operation not permitted when stream is capturing"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CannotRecord(f"recording failed: {first}") from e
        self.pool.graphs_recorded += 1
        bound[0] = static_args = None  # static inputs are read by address: hold no reference to them
        for i in in_place:
            inputs[i] = None
        outputs = list(outputs)
        input_views = _input_views(outputs, args, self.adopted)
        storages = lease = None
        handed_out = []  # the storages other recordings may read in place (_adopt)
        if track:
            handed = outputs if self.lent_from is None else outputs[:self.lent_from]
            storages = [o.untyped_storage() for o in handed if isinstance(o, torch.Tensor)]
            handed_out = [st for st in storages if st.nbytes()]  # an empty one has no address of its own
            if self.lent_from is not None:
                lease = torch.empty(1)
                storages.append(lease.untyped_storage())
        picker = _picker(in_place)
        handles = [s._cdata for s in storages or ()]
        # a recording computes nothing: the outputs hold garbage until the first replay
        instance = _Instance(replay, inputs, copied=[i for i, buf in enumerate(inputs) if buf is not None],
                             outputs=outputs, in_place=picker, in_place_ptrs=list(map(_DATA_PTR, picker(args))),
                             storages=storages, storage_handles=handles,
                             baseline_uses=list(map(_USE_COUNT, handles)), lease=lease,
                             rebuild=_rebuilder(spec_box[-1]), bound=bound, input_views=input_views)
        for storage in handed_out:
            _HANDED_OUT[storage.data_ptr()] = weakref.ref(instance)
        return instance


def _input_views(outputs: list, args: tuple, adopted: frozenset[int]) -> list[tuple]:
    """The outputs that are views of adopted inputs (`_Instance.input_views`); each is replaced
    by None in `outputs`."""
    if not adopted:
        return []
    storage_of = {args[i].untyped_storage().data_ptr(): i for i in adopted}
    views = []
    for j, o in enumerate(outputs):
        i = storage_of.get(o.untyped_storage().data_ptr()) if isinstance(o, torch.Tensor) and o.numel() else None
        if i is not None and o.dtype == args[i].dtype:
            views.append((j, i, tuple(o.shape), o.stride(), o.storage_offset()))
            outputs[j] = None
    return views


def _with_input_views(instance: _Instance, args: tuple) -> list:
    """The instance's static outputs with its views of adopted inputs made from `args`."""
    outputs = list(instance.outputs)
    for j, i, size, stride, offset in instance.input_views:
        outputs[j] = args[i].as_strided(size, stride, offset)
    return outputs


def _picker(positions: list[int]) -> Callable[[tuple], tuple]:
    """args -> the tuple of args at `positions` (one C call, as operator.itemgetter does)."""
    if len(positions) == 1:
        only = positions[0]
        return lambda args: (args[only],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


def _rebuilder(spec: pytree.TreeSpec) -> Callable[[list], object]:
    """flat outputs -> the result `spec` describes; a flat tuple or list (or list subclass: a
    compiled graph returns torch.fx's immutable_list) without pytree's walk."""
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    flat_sequence = spec.type is tuple or (isinstance(spec.type, type) and issubclass(spec.type, list))
    if flat_sequence and all(child.is_leaf() for child in children):
        return spec.type
    return lambda flat: pytree.tree_unflatten(flat, spec)


def _layout_key(args: tuple, keyed: Sequence[int]) -> tuple:
    """What selects a recording: the layout of every argument at `keyed`, those copied
    into a static buffer (`CudaGraphed._keyed`). Static inputs (module state, saved
    activations) are left out: their callers' guards or the forward's layout fix their
    layout, and a static input that moves is caught by `_moved` (densenet121's train
    step has ~1400 of them)."""
    key = []
    for i in keyed:
        a = args[i]
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, a.requires_grad))
        else:
            key.append((type(a), a if isinstance(a, (int, float, bool, str, type(None))) else id(a)))
    return tuple(key)


def _device_of(args: tuple) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


def _moved(instance: _Instance, args: tuple) -> bool:
    """Whether an input the recording reads in place lies elsewhere in this call."""
    return list(map(_DATA_PTR, instance.in_place(args))) != instance.in_place_ptrs


def _storage_uses(instance: _Instance) -> list[int]:
    """The use counts of the handed-out outputs' storages: tensors (and storage objects) sharing them."""
    return list(map(_USE_COUNT, instance.storage_handles))


def _outputs_alive(instance: _Instance) -> bool:
    """Whether the user still holds (a view of) an output of this graph's last replay (or
    the lease of its lent outputs): a storage used more than when it was recorded."""
    return any(map(operator.gt, _storage_uses(instance), instance.baseline_uses))


_DATA_PTR = torch.Tensor.data_ptr
_USE_COUNT = torch._C._storage_Use_Count


# data_ptr of each storage a tracked recording hands out -> that recording (_Instance), while it lives
_HANDED_OUT: dict[int, weakref.ref] = {}


def _handed_out(t: torch.Tensor) -> bool:
    """Whether `t` lies in an output that a live recording hands out (CudaGraphed._adopt)."""
    ptr = t.untyped_storage().data_ptr()
    ref = _HANDED_OUT.get(ptr)
    if ref is None:
        return False
    if ref() is None:  # that recording is gone; its memory may be anything's now
        del _HANDED_OUT[ptr]
        return False
    return True
