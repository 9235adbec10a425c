"""`module.parameters()`, `named_modules()` and the other walks of an nn.Module's tree in
captured code: run at capture time, each item read through its own source, the tree's
structure guarded."""
from __future__ import annotations

import torch

from torchweld.capture.objects import MODULE_WALKS, NNModuleValue
from torchweld.capture.sources import AttrSource, ModuleEntrySource, Source
from torchweld.capture.values import ConstantValue, Value
from torchweld.errors import Unsupported


class ModuleWalkValue(Value):
    """`module.parameters()`, `named_modules()`, ...: the items, each read through its own source
    (`L['self'].layers[0].weight`), with the tree's structure guarded (the names in every
    `_parameters`, `_buffers` and `_modules` dict walked), so a module added later recompiles."""

    def __init__(self, owner: NNModuleValue, name: str):
        self.owner, self.name = owner, name

    def call(self, tx, args, kwargs):
        from torchweld.capture.builder import wrap
        from torchweld.capture.values import IteratorValue, TupleValue

        module, name = self.owner.module, self.name
        options = {k: v.as_constant() for k, v in kwargs.items()}
        positional = [a.as_constant() for a in args]
        if "prefix" in options or "memo" in options or (name == "named_modules" and len(positional) > 0):
            raise Unsupported(f"{name}() with a memo or prefix is not modelled")
        guards = tx.output.guards
        for path, sub in module.named_modules(remove_duplicate=False):
            sub_source = _path_source(self.owner.source, path)
            for store in ("_parameters", "_buffers", "_modules"):
                guards.dict_keys(AttrSource(sub_source, store), list(sub.__dict__[store]))
        items = []
        for entry in getattr(module, name)(*positional, **options):
            path, obj = entry if name.startswith("named_") else (None, entry)
            if path is None:  # find its path: the first under which the unnamed walk yields it
                path = next(p for p, o in _named_walk(module, name, positional, options) if o is obj)
            value = wrap(tx, obj, _path_source(self.owner.source, path, MODULE_WALKS[name]))
            items.append(TupleValue([ConstantValue(path), value]) if name.startswith("named_") else value)
        return IteratorValue(items)


def _named_walk(module: torch.nn.Module, name: str, args: list, kwargs: dict):
    """The named form of walk `name`, with the same arguments (both forms take the same ones)."""
    named = name if name.startswith("named_") else f"named_{name}"
    if named == "named_children":
        return module.named_children()
    return getattr(module, named)(*args, **kwargs)


def _path_source(root: Source, path: str, last_store: str = "_modules") -> Source:
    """The source of `root.<path>` (`layers.0.weight`), each step read from its module dict."""
    source = root
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        source = ModuleEntrySource(source, part, last_store if i == len(parts) - 1 else "_modules")
    return source
