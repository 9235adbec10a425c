"""Translate one call of a frame into a cache entry: run the Translator, compile
the graph with the backend, and generate the entry that guards and runs it.
A frame capture cannot handle becomes an entry that runs it eagerly."""
from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import logging
import time
import types
import warnings
import weakref
from typing import Callable

import torch

from torchweld import config, fake_memo_disk, gc_pause, logs, timing
from torchweld.atomic_imports import imports_finish_first
from torchweld.capture import ddp_split, guard_extension, rank_compiles
from torchweld.capture.cache import CacheEntry, UserLine, build_entry, signature_of
from torchweld.capture.dynamic_dims import DimChoices
from torchweld.capture.eager_rerun import EagerRerun, rerun_plan
from torchweld.capture.inline import RealCellValue
from torchweld.capture.output_graph import OutputGraph, fake_errors_unlogged
from torchweld.capture.reconstruct import Reconstructor
from torchweld.capture.report import BreakReason, TranslationReport, publish
from torchweld.capture.sources import ClosureSource, shared_reads
from torchweld.capture.graph_break import BreakCodegen, can_break_at
from torchweld.capture.translator import StopBeforeBreak, Translator
from torchweld.errors import BackendCompilerFailed, TorchweldError, Unsupported


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: Callable  # backend(gm, example_inputs) -> callable
    backend_name: str
    fullgraph: bool = False
    mode: str | None = None
    options: dict | None = None
    dynamic: bool | None = None
    # called with each call's arguments before its frame is captured: the backend starts in
    # threads what its compile will wait for (backends.backend_warm_up)
    warm_up: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    # compiled wrappers of resume functions and of callees run at a break, made once; held
    # weakly (the entries that call them hold them), so that no cycle runs through the settings
    wrappers: weakref.WeakValueDictionary = dataclasses.field(
        default_factory=weakref.WeakValueDictionary, compare=False, repr=False)

    def wrapper(self, key: tuple, make: Callable[[], object]) -> object:
        """The wrapper kept under `key`, made by `make()` the first time."""
        found = self.wrappers.get(key)
        if found is None:
            found = self.wrappers[key] = make()
        return found


FULLGRAPH_HINT = (
    "fullgraph=True asks for the whole function as one graph, and this line needs Python. "
    "Remove fullgraph=True to let torchweld run it, or rewrite the line with tensor operations."
)


def translate_frame(fn: types.FunctionType, args: tuple, kwargs: dict, settings: CompileSettings,
                    dims: DimChoices | None = None) -> CacheEntry:
    """The cache entry for this call: a full graph, a graph up to a break, or eager;
    `dims` chooses its symbolic sizes (the compiled function keeps it across captures)."""
    if config.guard_evaluator == "c":
        guard_extension.load.start_in_background()  # built while the frame is traced
    if settings.warm_up is not None:
        settings.warm_up(args, kwargs)
    before = timing.snapshot()
    try:  # a Ctrl-C during one of the first compile's lazy imports waits for that import to finish
        with imports_finish_first(), timing.phase("capture"), gc_pause.paused(), fake_errors_unlogged():
            fake_memo_disk.load()  # (once per process) the fake results earlier processes learned
            return _translate_frame(fn, args, kwargs, settings, dims)
    finally:
        with timing.phase("fake_results.save"):
            fake_memo_disk.save()
        timing.log_frame(fn.__code__.co_qualname, before)


def _translate_frame(fn: types.FunctionType, args: tuple, kwargs: dict, settings: CompileSettings,
                     dims: DimChoices | None = None) -> CacheEntry:
    start = time.perf_counter()
    bound = inspect.signature(fn, follow_wrapped=False).bind(*args, **kwargs)
    bound.apply_defaults()
    _log_bytecode(fn)
    stop_at, failure, model_exceptions = None, None, True
    while True:
        tx = _translator(fn, dict(bound.arguments), dims)
        tx.stop_at = stop_at
        tx.output.model_exceptions = model_exceptions
        try:
            result = tx.run()
            rebuild = Reconstructor()
            return_expr = rebuild.expr(result)
            replay = tx.output.side_effects.replay(rebuild)  # may add graph outputs: before finishing
            body = [*rebuild.lines, *replay, f"return {return_expr}"]
            return _graph_entry(fn, tx, rebuild, body, settings, start)
        except StopBeforeBreak:
            if model_exceptions and _handling_a_captured_raise(tx):  # its exception state cannot be
                stop_at, failure, model_exceptions = None, None, False  # rebuilt natively: raises end the capture
                continue
            try:
                return _break_entry(fn, tx, failure, settings, start)
            except Unsupported as e:  # the state at the break cannot be rebuilt natively
                return _eager_entry(fn, tx.output, failure.at(tx.location()), time.perf_counter() - start,
                                    also=e.reason)
        except Unsupported as e:
            if settings.fullgraph:
                raise Unsupported(e.reason, e.location, FULLGRAPH_HINT) from None
            point = e.break_point
            if stop_at is None and point is not None and can_break_at(fn.__code__, tx.instructions[point[0]]):
                # translate again and stop right before that instruction; the failure is kept without
                # its traceback, whose frames (this one's included) would make a cycle through it
                stop_at, failure = point, _detached(e)
                continue
            return _eager_entry(fn, tx.output, e, time.perf_counter() - start)
        except TorchweldError:  # BackendCompilerFailed and friends are for the user to see
            raise
        except Exception as e:  # a bug in capture itself, not in the user's program
            if config.raise_internal_errors:
                raise
            where = tx.location()
            warnings.warn(f"torchweld: internal error while capturing {fn.__code__.co_qualname} at {where}: "
                          f"{type(e).__name__}: {e}; running it eagerly. Please report this.", stacklevel=2)
            failure = Unsupported(f"internal error in torchweld: {type(e).__name__}: {e}", where)
            return _eager_entry(fn, tx.output, failure, time.perf_counter() - start)


def _handling_a_captured_raise(tx: Translator) -> bool:
    """Whether the break falls inside an `except` block that a captured raise entered."""
    return bool(tx.exc_stack)


def _detached(error: Unsupported) -> Unsupported:
    """`error` without its traceback and chained exceptions, to be kept after its handler."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def _translator(fn: types.FunctionType, f_locals: dict, dims: DimChoices | None = None) -> Translator:
    code = fn.__code__
    output = OutputGraph(fn.__globals__, dims)
    cells = {
        name: RealCellValue(cell, ClosureSource(None, i, name))
        for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or ()))
    }
    return Translator(code, fn.__globals__, output, {}, cells, pending_locals=f_locals)


def _break_entry(fn, tx: Translator, failure: Unsupported, settings: CompileSettings, start: float) -> CacheEntry:
    rebuild = Reconstructor()
    statements = BreakCodegen(tx, fn, settings, rebuild).generate()
    tx.output.exit_autocast_regions()  # the stack's exit slots enter them again after the graph
    replay = tx.output.side_effects.replay(rebuild)
    text, call_site = failure.reason, tx.location()
    if failure.location is not None and failure.location != call_site:  # it failed inside a callee
        text += f" (inside the call at {call_site}: {call_site.source_line})"
    reason = BreakReason(text, failure.location, count=0)
    logs.get("graph_breaks").info("graph break in %s: %s", fn.__code__.co_qualname, reason)
    rebuild.constants["___reason"] = reason
    grad_restore = []  # contexts re-entered above set the mode; a bare set_grad_enabled() call did not
    if tx.output.grad_mode_changed:
        grad_restore.append(f"{rebuild.const(torch._C._set_grad_enabled)}({tx.output.grad_enabled})")
    # the break's own statements run the user's instruction: errors there name the user's line
    native = [UserLine(statement, call_site.lineno) for statement in statements]
    body = ["___reason.count += 1", *rebuild.lines, *replay, *grad_restore, *native]
    return _graph_entry(fn, tx, rebuild, body, settings, start, reason)


def _graph_entry(fn, tx: Translator, rebuild: Reconstructor, body: list[str], settings: CompileSettings,
                 start: float, reason: BreakReason | None = None) -> CacheEntry:
    """An entry that runs the graph, then `body` (which ends in a return); everything that
    adds graph outputs (return value, rebuilt stack, side-effect replay) is done before."""
    output = tx.output
    gm, example_inputs, input_sources = output.finish(rebuild.graph_outputs)
    prefix = []
    if output.op_count() > 0:
        compiled = _compile_graph(gm, example_inputs, settings, tx)
        if compiled is None:  # the backend failed and config.suppress_errors asked to go on
            failed = Unsupported(f"backend {settings.backend_name!r} failed")
            return _eager_entry(fn, output, failed, time.perf_counter() - start)
        rebuild.constants["___graph"] = compiled
        reads, arguments = shared_reads(input_sources)
        call = f"___out = ___graph({', '.join(arguments)})"
        plan = rerun_plan(gm)
        if plan is not None:  # an error it raises is raised (or handled) by the frame run eagerly
            rebuild.constants["___rerun"] = EagerRerun(fn, plan, output.initial_grad_enabled)
            _, passes = signature_of(fn.__code__)
            saved = ["___rng = ___rerun.save()"] if plan.generators else []
            rerun = f"return ___rerun(___error, {'___rng' if plan.generators else 'None'}{', ' if passes else ''}{passes})"
            if plan.written_inputs:  # rerun only if the graph raised before its first write
                # the inputs' version counters, read inline (a call per call costs ~0.6 us)
                versions = "(" + "".join(f"{arguments[i]}._version, " for i in plan.written_inputs) + ")"
                saved.append(f"___versions = {versions}")
                handler = [f"    if {versions} == ___versions:", f"        {rerun}", "    raise"]
            else:
                handler = [f"    {rerun}"]
            prefix += [*reads, *saved, "try:", f"    {call}", "except Exception as ___error:", *handler]
        else:
            prefix += [*reads, call]
        if output.grad_mode_changed:  # whatever the backend did with the graph's grad-mode nodes
            # a break re-enters its contexts from the frame's starting mode; a return keeps the last mode
            final = output.initial_grad_enabled if reason is not None else output.grad_enabled
            prefix.append(f"{rebuild.const(torch._C._set_grad_enabled)}({final})")
    report = TranslationReport(
        function=fn.__code__.co_qualname, graph=gm if output.op_count() else None, op_count=output.op_count(),
        guards=output.guards.readable(), compile_time_s=time.perf_counter() - start, break_reason=reason,
    )
    entry = build_entry(fn, output.guards, prefix + body, rebuild.constants, report)
    _log_translation(fn, entry)
    publish(report)
    rank_compiles.note(fn.__code__, report)
    return entry


def _compile_graph(gm, example_inputs, settings: CompileSettings, tx: Translator) -> Callable | None:
    if logs.get("graph").isEnabledFor(logging.INFO):  # (the text costs a code generation: only when logged)
        logs.get("graph").info("graph of %s:\n%s", tx.code.co_qualname, gm.print_readable(print_output=False))
    if logs.get("graph_code").isEnabledFor(logging.INFO):
        logs.get("graph_code").info("graph code of %s:\n%s", tx.code.co_qualname, gm.code)
    try:
        with timing.phase("backend"):
            compiled = ddp_split.run_backend(functools.partial(ddp_split.compile_graph, settings.backend,
                                                               settings.backend_name), gm, example_inputs)
    except Exception as e:
        if config.suppress_errors:
            warnings.warn(f"torchweld: backend {settings.backend_name!r} failed ({type(e).__name__}: {e}); "
                          f"running {tx.code.co_qualname} eagerly", stacklevel=2)
            return None
        raise BackendCompilerFailed(settings.backend_name, e, tx.location()) from e
    return compiled


def _eager_entry(fn: types.FunctionType, output: OutputGraph, error: Unsupported, seconds: float,
                 also: str = "") -> CacheEntry:
    text = f"{error.reason} (and the graph could not be broken there: {also})" if also else error.reason
    reason = BreakReason(text, error.location, count=0)
    logs.get("graph_breaks").info("frame %s runs eagerly: %s", fn.__code__.co_qualname, reason)
    _, passes = signature_of(fn.__code__)
    report = TranslationReport(fn.__code__.co_qualname, None, 0, output.guards.readable(), seconds, reason)
    body = ["___reason.count += 1", f"return ___fn({passes})"]
    entry = build_entry(fn, output.guards, body, {"___fn": fn, "___reason": reason}, report)
    publish(report)
    rank_compiles.note(fn.__code__, report)
    return entry


def _log_bytecode(fn: types.FunctionType) -> None:
    log = logs.get("bytecode")
    if log.isEnabledFor(logging.INFO):
        log.info("bytecode of %s:\n%s", fn.__code__.co_qualname, dis.Bytecode(fn.__code__).dis())


def _log_translation(fn: types.FunctionType, entry: CacheEntry) -> None:
    logs.get("guards").info("guards of %s:\n  %s", fn.__code__.co_qualname, "\n  ".join(entry.report.guards))
    logs.get("bytecode").info("entry of %s:\n%s", fn.__code__.co_qualname, entry.source)
