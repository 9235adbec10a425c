"""Named log artifacts (`TORCHWELD_LOGS=graph_breaks,+guards`) on the `torchweld` logger.

Each artifact is a child logger, `torchweld.<name>`. Naming it turns it on at
INFO; a leading `+` turns on DEBUG detail. `all` turns every artifact on. Where
TORCHWELD_LOGS is unset, torch.compile's TORCH_LOGS turns on the artifacts torchweld
has too (TORCH_ARTIFACTS).
"""
from __future__ import annotations

import logging
import sys

ARTIFACTS = ("graph", "graph_code", "guards", "recompiles", "graph_breaks", "bytecode", "weld", "output_code", "compile_times",
             "cache", "dynamic")

root = logging.getLogger("torchweld")
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("[torchweld %(name)s] %(message)s"))


def get(artifact: str) -> logging.Logger:
    if artifact not in ARTIFACTS:
        raise ValueError(f"unknown log artifact {artifact!r}; known: {', '.join(ARTIFACTS)}")
    return logging.getLogger(f"torchweld.{artifact}")


def parse(spec: str) -> dict[str, int]:
    """`"graph_breaks,+guards"` -> {"graph_breaks": INFO, "guards": DEBUG}."""
    levels: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        level = logging.DEBUG if item.startswith("+") else logging.INFO
        name = item.lstrip("+")
        names = ARTIFACTS if name == "all" else (name,)
        for artifact in names:
            if artifact not in ARTIFACTS:
                raise ValueError(f"TORCHWELD_LOGS: unknown artifact {artifact!r}; known: all, {', '.join(ARTIFACTS)}")
            levels[artifact] = level
    return levels


# TORCH_LOGS artifact -> torchweld's counterpart (a leading "+" asks for its DEBUG detail)
TORCH_ARTIFACTS = {"graph_breaks": "graph_breaks", "recompiles": "recompiles", "recompiles_verbose": "+recompiles",
                   "guards": "guards", "graph": "graph", "graph_code": "graph_code", "output_code": "output_code",
                   "bytecode": "bytecode", "dynamic": "dynamic"}


def from_torch_logs(spec: str) -> str:
    """TORCH_LOGS's artifacts that torchweld has too, in TORCHWELD_LOGS's form:
    `"+dynamo,graph_breaks,recompiles_verbose"` -> `"graph_breaks,+recompiles"`."""
    items = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        plus, name = item.startswith("+"), item.lstrip("+-")
        mapped = TORCH_ARTIFACTS.get(name)
        if mapped is not None and not item.startswith("-"):
            items.append("+" + mapped.lstrip("+") if plus else mapped)
    return ",".join(items)


def configure() -> None:
    """Apply `torchweld.config.logs` (where None, config.torch_logs's counterparts) to the artifact loggers."""
    from torchweld import config

    levels = parse(config.logs if config.logs is not None else from_torch_logs(config.torch_logs))
    for artifact in ARTIFACTS:
        logger = logging.getLogger(f"torchweld.{artifact}")
        logger.setLevel(levels.get(artifact, logging.WARNING))
    if levels and _handler not in root.handlers:
        root.addHandler(_handler)
    if not levels and _handler in root.handlers:
        root.removeHandler(_handler)
