"""The settings of the graph-leaf modules weld compiled into a graph (`bn.momentum`, `bn.eps`,
`conv.stride`), checked at each call: a changed one compiles the graph again.

A `call_module` node of the captured graph reads its module's settings when it runs; weld's
trace reads them once and writes them into its kernels as numbers. Capture guards a leaf's
parameters, buffers and `training`, not its other attributes, so `bn.momentum = 0.5` between
two calls reached the captured graph (the capture-only backend) but not weld's kernels: the
running statistics came out wrong. The check reads each leaf's plain attributes with one
`operator.attrgetter` (about 0.2 us a module) and compares them with those compiled for.
"""
from __future__ import annotations

import logging
import operator
from typing import Callable

import torch

from torchweld.backends.weld_declines import UNTRACEABLE
from torchweld.tuning import tuning

log = logging.getLogger("torchweld.weld")

SETTING_TYPES = (bool, int, float, str, type(None), tuple)
# settings captured graphs are guarded on already (capture/guards.py)
GUARDED_BY_CAPTURE = frozenset({"training"})


def leaf_settings(gm: torch.fx.GraphModule) -> list[tuple[torch.nn.Module, Callable]]:
    """(module, a getter of its settings) for each module `gm` calls (and their submodules)
    that has plain-valued public attributes: the values weld's trace may have read."""
    found, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        for module in gm.get_submodule(node.target).modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            names = sorted(k for k, v in module.__dict__.items() if not k.startswith("_")
                           and k not in GUARDED_BY_CAPTURE and isinstance(v, SETTING_TYPES))
            if names:
                found.append((module, operator.attrgetter(*names)))
    return found


def read_settings(settings: list) -> tuple:
    """The values of `settings` (leaf_settings' pairs) now."""
    return tuple(get(module) for module, get in settings)


class SettingsGuarded:
    """`compile_(inputs)`'s callable for the leaf settings of the call; compiled again, with that
    call's inputs as examples, for settings not met before (`exact`, the captured graph, past
    tuning.variants_limit of them)."""

    def __init__(self, compile_: Callable[[list], Callable], settings: list, exact: Callable, example_inputs: list):
        self.compile_, self.settings, self.exact = compile_, settings, exact
        self.key = self.read()
        self.current = compile_(list(example_inputs))
        self.variants = {self.key: self.current}

    def read(self) -> tuple:
        return read_settings(self.settings)

    def __call__(self, *args):
        key = self.read()
        if key != self.key:
            self.key, self.current = key, self.variant(key, args)
        return self.current(*args)

    def variant(self, key: tuple, args: tuple) -> Callable:
        found = self.variants.get(key)
        if found is not None:
            return found
        if len(self.variants) >= tuning.variants_limit:
            log.warning("the settings of this graph's modules changed %d times; it runs as captured, "
                        "without weld's kernels, for settings met after that", tuning.variants_limit)
            found = self.exact
        else:
            log.info("a setting of a module this graph calls changed since weld compiled it: compiling it again")
            try:
                found = self.compile_(list(args))
            except UNTRACEABLE as e:  # `momentum=None` reads the batch counter as a Python number
                log.warning("weld cannot trace this graph for its modules' new settings (%s: %s); it runs as "
                            "captured for them", type(e).__name__, e)
                found = self.exact
        self.variants[key] = found
        return found

    def __getattr__(self, name: str):
        """The compiled graph's attributes (`schedule`, `wrapper_source`, ...), for tools and tests."""
        if name in ("current", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.current, name)
