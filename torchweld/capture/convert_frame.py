"""Translate one call of a frame into a cache entry: run the Translator, compile
the graph with the backend, and generate the entry that guards and runs it.
A frame capture cannot handle becomes an entry that runs it eagerly."""
from __future__ import annotations

import dataclasses
import dis
import inspect
import logging
import time
import types
import warnings
from typing import Callable

import torch

from torchweld import config, logs
from torchweld.capture.cache import CacheEntry, build_entry, signature_of
from torchweld.capture.inline import RealCellValue
from torchweld.capture.output_graph import OutputGraph
from torchweld.capture.reconstruct import Reconstructor
from torchweld.capture.report import BreakReason, TranslationReport, publish
from torchweld.capture.sources import ClosureSource
from torchweld.capture.translator import Translator
from torchweld.errors import BackendCompilerFailed, Unsupported


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: Callable  # backend(gm, example_inputs) -> callable
    backend_name: str
    fullgraph: bool = False
    mode: str | None = None
    options: dict | None = None
    dynamic: bool | None = None


FULLGRAPH_HINT = (
    "fullgraph=True asks for the whole function as one graph, and this line needs Python. "
    "Remove fullgraph=True to let torchweld run it, or rewrite the line with tensor operations."
)


def translate_frame(fn: types.FunctionType, args: tuple, kwargs: dict, settings: CompileSettings) -> CacheEntry:
    start = time.perf_counter()
    code = fn.__code__
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    output = OutputGraph(fn.__globals__)
    cells = {
        name: RealCellValue(cell, ClosureSource(None, i, name))
        for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or ()))
    }
    tx = Translator(code, fn.__globals__, output, {}, cells, pending_locals=dict(bound.arguments))
    _log_bytecode(fn)
    try:
        result = tx.run()
        rebuild = Reconstructor()
        return_expr = rebuild.expr(result)
    except Unsupported as e:
        if settings.fullgraph:
            raise Unsupported(e.reason, e.location, FULLGRAPH_HINT) from None
        return _eager_entry(fn, output, e, time.perf_counter() - start)
    except Exception as e:  # a bug in capture itself, not in the user's program
        if config.raise_internal_errors:
            raise
        where = tx.location()
        warnings.warn(f"torchweld: internal error while capturing {code.co_qualname} at {where}: "
                      f"{type(e).__name__}: {e}; running it eagerly. Please report this.", stacklevel=2)
        failure = Unsupported(f"internal error in torchweld: {type(e).__name__}: {e}", where)
        return _eager_entry(fn, output, failure, time.perf_counter() - start)

    gm, example_inputs, input_sources = output.finish(rebuild.graph_outputs)
    body = []
    if output.op_count() > 0:
        compiled = _compile_graph(gm, example_inputs, settings, tx)
        if compiled is None:  # the backend failed and config.suppress_errors asked to go on
            return _eager_entry(fn, output, Unsupported(f"backend {settings.backend_name!r} failed"), time.perf_counter() - start)
        rebuild.constants["___graph"] = compiled
        body.append(f"___out = ___graph({', '.join(s.expr() for s in input_sources)})")
    body.append(f"return {return_expr}")
    report = TranslationReport(
        function=code.co_qualname, graph=gm if output.op_count() else None, op_count=output.op_count(),
        guards=output.guards.readable(), compile_time_s=time.perf_counter() - start,
    )
    entry = build_entry(fn, output.guards, body, rebuild.constants, report)
    _log_translation(fn, entry)
    publish(report)
    return entry


def _compile_graph(gm, example_inputs, settings: CompileSettings, tx: Translator) -> Callable | None:
    logs.get("graph").info("graph of %s:\n%s", tx.code.co_qualname, gm.print_readable(print_output=False))
    logs.get("graph_code").info("graph code of %s:\n%s", tx.code.co_qualname, gm.code)
    try:
        compiled = settings.backend(gm, example_inputs)
        if not callable(compiled):
            raise TypeError(f"the backend returned {compiled!r}, which is not callable")
    except Exception as e:
        if config.suppress_errors:
            warnings.warn(f"torchweld: backend {settings.backend_name!r} failed ({type(e).__name__}: {e}); "
                          f"running {tx.code.co_qualname} eagerly", stacklevel=2)
            return None
        raise BackendCompilerFailed(settings.backend_name, e, tx.location()) from e
    return compiled


def _eager_entry(fn: types.FunctionType, output: OutputGraph, error: Unsupported, seconds: float) -> CacheEntry:
    reason = BreakReason(error.reason, error.location, count=0)
    logs.get("graph_breaks").info("frame %s runs eagerly: %s", fn.__code__.co_qualname, reason)
    _, passes = signature_of(fn.__code__)
    report = TranslationReport(fn.__code__.co_qualname, None, 0, output.guards.readable(), seconds, reason)
    body = ["___reason.count += 1", f"return ___fn({passes})"]
    entry = build_entry(fn, output.guards, body, {"___fn": fn, "___reason": reason}, report)
    publish(report)
    return entry


def _log_bytecode(fn: types.FunctionType) -> None:
    log = logs.get("bytecode")
    if log.isEnabledFor(logging.INFO):
        log.info("bytecode of %s:\n%s", fn.__code__.co_qualname, dis.Bytecode(fn.__code__).dis())


def _log_translation(fn: types.FunctionType, entry: CacheEntry) -> None:
    logs.get("guards").info("guards of %s:\n  %s", fn.__code__.co_qualname, "\n  ".join(entry.report.guards))
    logs.get("bytecode").info("entry of %s:\n%s", fn.__code__.co_qualname, entry.source)
