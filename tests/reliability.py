"""What a damaged disk cache, an interrupt or a crowd of processes does to a torchweld
program, each scenario run in a fresh Python process (a regression may crash it with
SIGBUS or SIGSEGV; the caller's process survives to say so). Used by the tests
(tests/runtime/test_cache_healing.py, tests/test_atomic_imports.py) and by
bench/reliability.py, which prints them all as a table.

    cache = tmp_path / "cache"
    assert run_program(cache, "first").ok             # fills the cache (the first function's kernel)
    DAMAGES["truncated kernel .so"].apply(cache)
    outcome = run_program(cache, "first")             # a correct run, and one warning
    assert outcome.ok and len(outcome.warnings) == 1
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]

# Two compiled functions checked against eager. `first` compiles only the first (to fill a
# cache that then lacks the second's kernel); `delete` removes the cache between the two.
PROGRAM = textwrap.dedent("""
    import os, shutil, sys
    import torch, torchweld

    x = torch.randn(64, 8)
    f = torchweld.compile(lambda x: (x.sin() * 2 + x.cos()).sum(0))
    torch.testing.assert_close(f(x), (x.sin() * 2 + x.cos()).sum(0))
    if "delete" in sys.argv:
        shutil.rmtree(torchweld.config.cache_dir)
    if "first" not in sys.argv:
        g = torchweld.compile(lambda x: x.tanh() * 3 - 1)
        torch.testing.assert_close(g(x), x.tanh() * 3 - 1)
    print("OK")
""")

# The first call interrupted by the parent's SIGINT (during its compile, or after it, while
# it sleeps), then calls that must work: the same function, and a new one.
INTERRUPTED_PROGRAM = textwrap.dedent("""
    import sys, time
    import torch, torchweld

    x = torch.randn(64, 8)
    f = torchweld.compile(lambda x: (x.sin() * 2 + x.cos()).sum(0))
    print("ready", flush=True)
    try:
        f(x)
        print("compiled before the interrupt", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    torch.testing.assert_close(f(x), (x.sin() * 2 + x.cos()).sum(0))
    g = torchweld.compile(lambda x: x.tanh() * 3 - 1)
    torch.testing.assert_close(g(x), x.tanh() * 3 - 1)
    print("OK")
""")

# The same for a compiled training step (forward, backward compiled in a thread, Adam): then
# steps from the weights and optimizer state the interrupted step left, against eager's.
INTERRUPTED_TRAINING_PROGRAM = textwrap.dedent("""
    import copy, time
    import torch, torchweld

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                   torch.nn.Linear(32, 1))

    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(0)
    model, x = make(), torch.randn(16, 8)
    opt = torch.optim.Adam(model.parameters())
    compiled = torchweld.compile(step)
    print("ready", flush=True)
    try:
        compiled(model, opt, x)
        print("compiled before the interrupt", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    ref = make()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state tensors, not opt's
    for _ in range(3):
        torch.testing.assert_close(compiled(model, opt, x), step(ref, ref_opt, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    print("OK")
""")


@dataclasses.dataclass
class Outcome:
    """How one process ended."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.stdout.rstrip().endswith("OK")

    @property
    def warnings(self) -> list[str]:
        """torchweld's warnings (one line each, on stderr)."""
        return [line for line in self.stderr.splitlines() if line.startswith("torchweld:")]

    @property
    def signal_name(self) -> str:
        return signal.Signals(-self.returncode).name if self.returncode < 0 else ""

    def describe(self) -> str:
        end = self.signal_name or f"exit {self.returncode}"
        return f"{end}; stdout: {self.stdout.strip()[-300:]!r}; stderr: {self.stderr.strip()[-1500:]}"


def environment(cache: Path | str | None, **changes: str | None) -> dict[str, str]:
    """This process's environment with TORCHWELD_CACHE_DIR=`cache` (None: unset) and `changes`
    (a None value unsets a variable). The C helpers are built in `cache` too (TORCHWELD_HELPERS_DIR),
    so that what these tests damage and count there is all the process uses."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    helpers = str(cache) if cache else None
    for name, value in {"TORCHWELD_CACHE_DIR": None if cache is None else str(cache),
                        "TORCHWELD_HELPERS_DIR": helpers, **changes}.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_program(cache: Path | str | None, *args: str, env: dict | None = None, prefix: list[str] = (),
                cwd: Path | str | None = None, timeout: float = 240) -> Outcome:
    """PROGRAM run in a new process with the cache at `cache` (see `environment`)."""
    start = time.perf_counter()
    proc = subprocess.run([*prefix, sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True,
                          env=env or environment(cache), cwd=cwd, timeout=timeout)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


def run_concurrently(cache: Path, processes: int, timeout: float = 300) -> list[Outcome]:
    """PROGRAM run by `processes` processes at once, all with the cache at `cache`."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=environment(cache)) for _ in range(processes)]
    outcomes = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        outcomes.append(Outcome(proc.returncode, stdout, stderr, time.perf_counter() - start))
    return outcomes


def run_interrupted(cache: Path, delay: float, timeout: float = 240, program: str = INTERRUPTED_PROGRAM) -> Outcome:
    """`program` (INTERRUPTED_PROGRAM or INTERRUPTED_TRAINING_PROGRAM), sent SIGINT `delay`
    seconds after it starts its first call."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment(cache))
    try:
        first = proc.stdout.readline()
        if first.strip() == "ready":
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Outcome(proc.returncode, first + stdout, stderr, time.perf_counter() - start)


# -- damage done to a filled cache --------------------------------------------------------
def libraries(cache: Path, kind: str) -> list[Path]:
    """The libraries of `kind` ("cpp": generated kernels; "guards": the guard evaluator) in `cache`."""
    return sorted((cache / kind).glob("*.so"))


def library(cache: Path, kind: str) -> Path:
    """The one library of `kind` in `cache` (filled by PROGRAM's `first` part)."""
    found = libraries(cache, kind)
    assert len(found) == 1, f"expected one library in {cache / kind}, found {found}"
    return found[0]


@dataclasses.dataclass(frozen=True)
class Damage:
    """Something done to a cache filled by `run_program(cache, "first")`, and how many
    entries it damages: the warnings the next such run gives."""

    apply: Callable[[Path], object]
    entries: int = 1


def _truncate(path: Path, size: int = 4000) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _swap(a: Path, b: Path) -> None:
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)


def _cpp_source_without_library(cache: Path) -> None:
    kernel = library(cache, "cpp")
    kernel.with_suffix(".cpp").write_text("this is not C++ {\n")
    kernel.unlink()


DAMAGES: dict[str, Damage] = {
    "truncated kernel .so": Damage(lambda cache: _truncate(library(cache, "cpp"))),
    "truncated guard .so": Damage(lambda cache: _truncate(library(cache, "guards"))),
    "garbage kernel .so": Damage(lambda cache: library(cache, "cpp").write_bytes(os.urandom(20000))),
    "empty kernel .so": Damage(lambda cache: library(cache, "cpp").write_bytes(b"")),
    "guard .so in the kernel's place": Damage(
        lambda cache: library(cache, "cpp").write_bytes(library(cache, "guards").read_bytes())),
    "kernel and guard .so swapped": Damage(lambda cache: _swap(library(cache, "cpp"), library(cache, "guards")),
                                           entries=2),
    "corrupt .cpp without .so": Damage(_cpp_source_without_library),
    "corrupt wrapper .py": Damage(lambda cache: [p.write_text("garbage(") for p in (cache / "wrappers").glob("*.py")]),
}


# -- directories torchweld cannot write -------------------------------------------------------
@contextlib.contextmanager
def read_only(path: Path) -> Iterator[list[str] | None]:
    """`path` made read-only for the processes started under the command prefix this yields:
    by permissions for a user, by a read-only bind mount in a mount namespace of its own for
    root (whom permissions do not stop). None where this machine offers neither."""
    if os.geteuid() != 0:
        folders = [path, *(p for p in path.rglob("*") if p.is_dir())]
        modes = {p: p.stat().st_mode for p in folders}
        for p in folders:
            p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield []
        finally:
            for p in reversed(folders):
                p.chmod(modes[p])
        return
    prefix = ["unshare", "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(path)]
    probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{path}/.probe" 2>/dev/null'], capture_output=True)
    yield prefix if shutil.which("unshare") and probe.returncode == 0 else None


def unwritable_home() -> Path:
    """A HOME under which ~/.cache cannot be made: a regular file, not a directory."""
    fd, path = tempfile.mkstemp(prefix="torchweld-not-a-home-")
    os.close(fd)
    return Path(path)


def badly_sealed(cache: Path) -> list[Path]:
    """The libraries in `cache` whose seal (torchweld/disk_cache.py) does not match their bytes
    and the key in their name."""
    import hashlib
    import re

    from torchweld.disk_cache import SEAL

    bad = []
    for path in cache.glob("*/*.so"):
        data = path.read_bytes()
        key = re.search(r"[0-9a-f]{24}", path.name).group(0)
        body, seal = data[:-len(SEAL) - 32], data[-len(SEAL) - 32:]
        if seal != SEAL + hashlib.sha256(body + b"\0" + key.encode()).digest():
            bad.append(path)
    return bad
