"""Write and read benchmark records: one JSON object a line in bench/records/<suite>.jsonl,
each carrying where and how its figures were made (commit, host, GPU, library versions,
command) beside the figures themselves.

Every record has these keys; a suite adds its own under "figures" (and, for the harness,
"row", the identity of one table row):

    bench     the suite's name, also the file's: "models", "fuzz", "reliability"
    source    "run" (measured by the command), or "diary" (copied from the old
              bench/investigations/RESULTS-diary.md, with "diary_section")
    date      UTC, ISO 8601, seconds
    commit    git HEAD of the checkout (full hash); dirty: torchweld/ had uncommitted changes
    host, cpu, cores, gpu (None without CUDA), python, versions {torch, triton, ...}, torch,
    environment (the OMP_*, MALLOC_*, TORCHWELD_*, TORCHINDUCTOR_* and TRITON_* variables set)
    command   the command line as typed, relative to the checkout
    options   the parsed command-line options
    figures   what was measured

The directory defaults to bench/records/ and is replaced by TORCHWELD_BENCH_RECORDS
(tests write to a temporary one).
"""
from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
VERSIONED = ("torch", "triton", "torchvision", "transformers", "numpy")
ENVIRONMENT = ("OMP_", "MALLOC_", "TORCHWELD_", "TORCHINDUCTOR_", "TRITON_", "CUDA_VISIBLE_DEVICES")  # recorded


def records_dir() -> Path:
    return Path(os.environ.get("TORCHWELD_BENCH_RECORDS") or ROOT / "bench" / "records")


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def versions() -> dict[str, str | None]:
    """Installed versions of the libraries a figure depends on (None where missing); read from
    the package metadata, so nothing is imported."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if "torch" in sys.modules:  # the build's own string (2.13.0+cpu), where metadata may differ
        found["torch"] = sys.modules["torch"].__version__
    return found


def gpu_name() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, the script's path relative to the checkout where it lies inside."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + " ".join(shlex.quote(a) for a in argv)


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """Where a figure was made: the same for every record a process writes."""
    found = versions()
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "torchweld")),
        "host": platform.node(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "versions": found,
        "torch": found["torch"],  # also at the top, as the first records of fuzz and reliability have it
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(ENVIRONMENT) and k != "TORCHWELD_BENCH_RECORDS"},
    }


def make_record(suite: str, figures, options: dict | None = None, command: str | None = None, **extra) -> dict:
    return {"bench": suite, "source": "run",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **provenance(), "command": command or command_line(), "options": options or {}, **extra,
            "figures": figures}


def append(suite: str, records: list[dict] | dict) -> Path:
    """Append `records` (one or a list) to <records dir>/<suite>.jsonl; returns the file."""
    path = records_dir() / f"{suite}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [records] if isinstance(records, dict) else records
    lines = "".join(json.dumps(_clean(r), allow_nan=False) + "\n" for r in records)
    with path.open("a") as f:  # one write: records of processes appending at once do not interleave
        f.write(lines)
    return path


def read(suite: str | None = None, directory: Path | None = None) -> Iterator[dict]:
    """The records of one suite, or of every suite, in the order they were written."""
    directory = directory or records_dir()
    paths = [directory / f"{suite}.jsonl"] if suite else sorted(directory.glob("*.jsonl"))
    for path in paths:
        if not path.exists():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None


def _clean(value):
    """`value` as strict JSON: NaN and infinities (a failed or missing figure) become null, paths strings."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
