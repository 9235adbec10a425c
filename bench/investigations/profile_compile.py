"""Where weld's cold compile time goes, for one GPU case of bench/investigations/gpu_inference.py.

    python3 bench/investigations/profile_compile.py densenet121 [--mode MODE] [--top 30] [--cprofile] [--thread-cpu] [--blocked] [--train] [--dynamic]

Runs the first call (capture, lowering, scheduling, code generation, Triton
compiles, the first run) in this fresh process with empty torchweld and Triton
caches, and prints its wall time and `torchweld.compile_times()` (seconds per
phase). With --cprofile the call runs under cProfile, and the top functions by
cumulative and by own time follow. Triton compiles run in a thread pool:
cProfile sees only the main thread waiting for them (`Future.result`). With --thread-cpu,
each phase is listed per kind of thread (main, backward, Triton loading) with its wall time and
that thread's CPU time in it: wall well above CPU is time spent waiting (on the GIL, a lock, a
worker), CPU near wall is work done there; the CPU column of all threads together is what
the GIL serializes. With --cpu-timeline, every 0.25 s of the call gets a row: the CPU
seconds each thread of this process used in it and the whole machine's busy cores (from
/proc/stat), which shows what competes with the main thread when its wall time exceeds its CPU
time (another thread holding the GIL, or every core busy). With --blocked, the main thread is sampled
every 2 ms, and each interval in which it used less than half a core is charged to where it was
then: the frames at which the first call waited, longest first. With --train, the case is a training row of
bench/investigations/compare.py (densenet121, resnet50, BERT, GPT-2) and the first call is its first
step: the model compiled, forward, loss, backward (the backward's compile included), Adam.
With --callers NAME (and --cprofile), who called the functions whose name matches NAME.
With --dynamic, the model is compiled with dynamic=True: its sizes are symbols from the first call
(the compile over symbols whose cold time issue 45 compares with the static one).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import tempfile
import threading
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402

import torchweld  # noqa: E402
from compare import training_cases  # noqa: E402
from gpu_inference import cases  # noqa: E402
from torchweld import config, timing  # noqa: E402


def thread_cpu() -> dict[tuple[str, str], list]:
    """Record, from now on, each phase's [calls, wall s, thread CPU s] per kind of thread
    (the thread's name without its pool index: MainThread, torchweld-backward, torchweld-triton)."""
    rows: dict[tuple[str, str], list] = {}
    phase = timing.phase

    @contextlib.contextmanager
    def measured(name):
        wall, cpu = time.perf_counter(), time.thread_time()
        with phase(name):
            yield
        key = (threading.current_thread().name.rstrip("0123456789").rstrip("_"), name)
        with lock:
            row = rows.setdefault(key, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - wall
            row[2] += time.thread_time() - cpu

    lock = threading.Lock()
    timing.phase = measured  # the compiler looks timing.phase up at each use
    return rows


class CpuTimeline:
    """Samples, every `step` seconds in a thread of its own, each Python thread's CPU clock and the
    machine's busy time (/proc/stat), until stop()."""

    def __init__(self, step: float = 0.25):
        self.step = step
        self.rows: list[tuple[float, dict[str, float], float, str]] = []  # (t, {thread: cpu s}, busy cores, main's frames)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-timeline")
        self._thread.start()

    @staticmethod
    def _busy_seconds() -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> tuple[float, dict[str, float], float]:
        clocks = {}
        for t in threading.enumerate():
            if t is self._thread or t.native_id is None:
                continue
            try:
                clocks[f"{t.name}:{t.native_id}"] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                pass
        return time.perf_counter(), clocks, self._busy_seconds(), self._main_frames()

    @staticmethod
    def _main_frames() -> str:
        """The main thread's innermost frames now, innermost first: where it is, for a row where it used no CPU."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        where = []
        while frame is not None and len(where) < 4:
            code = frame.f_code
            where.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        return " < ".join(where)

    def _run(self) -> None:
        last = self._sample()
        while not self._done.wait(self.step):
            now = self._sample()
            cpu = {k: v - last[1].get(k, 0.0) for k, v in now[1].items()}
            self.rows.append((now[0], cpu, (now[2] - last[2]) / (now[0] - last[0]), now[3]))
            last = now

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def print(self) -> None:
        if not self.rows:
            return
        main = f"MainThread:{threading.main_thread().native_id}"
        names = sorted({main} | {k for _, cpu, _, _ in self.rows for k, v in cpu.items() if v > 0.01})
        t0 = self.rows[0][0] - self.step
        print(f"\nCPU seconds per {self.step} s, per thread of this process, and the machine's busy cores")
        print(f"{'t s':>6s} {'busy':>5s} " + " ".join(f"{n.split(':')[0][:16]:>16s}" for n in names))
        for t, cpu, busy, frames in self.rows:
            idle = cpu.get(main, 0.0) < 0.3 * self.step
            print(f"{t - t0:6.2f} {busy:5.1f} " + " ".join(f"{cpu.get(n, 0.0):16.3f}" for n in names)
                  + (f"  main at {frames}" if idle else ""))


class BlockedSampler:
    """Samples the main thread every `step` seconds, in a thread of its own, until stop(): where
    its CPU clock advanced by less than half the interval, the main thread was not running
    (waiting for the GIL, a lock, a worker, the GPU or a file), and the interval is charged to
    its innermost frames then. print() lists the frames that waited longest."""

    def __init__(self, step: float = 0.002, depth: int = 6):
        self.step, self.depth = step, depth
        self.waited: dict[str, float] = {}
        self._main = threading.main_thread()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="blocked-sampler")
        self._thread.start()

    def _frames(self) -> str:
        frame = sys._current_frames().get(self._main.ident)
        where = []
        while frame is not None and len(where) < self.depth:
            code = frame.f_code
            where.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        return " < ".join(where)

    def _run(self) -> None:
        clock = time.pthread_getcpuclockid(self._main.ident)
        last_wall, last_cpu = time.perf_counter(), time.clock_gettime(clock)
        while not self._done.wait(self.step):
            wall, cpu = time.perf_counter(), time.clock_gettime(clock)
            if cpu - last_cpu < 0.5 * (wall - last_wall):
                where = self._frames()
                self.waited[where] = self.waited.get(where, 0.0) + (wall - last_wall) - (cpu - last_cpu)
            last_wall, last_cpu = wall, cpu

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def print(self, top: int) -> None:
        total = sum(self.waited.values())
        print(f"\nThe main thread not running: {total:.3f} s; where it was, longest first")
        for where, seconds in sorted(self.waited.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{seconds:7.3f}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="first word of a gpu_inference.py row, e.g. densenet121")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--thread-cpu", action="store_true", help="each thread's CPU time next to wall time per phase")
    parser.add_argument("--train", action="store_true", help="the first training step of compare.py's row")
    parser.add_argument("--cpu-timeline", action="store_true", help="CPU per thread and busy cores, per 0.25 s")
    parser.add_argument("--blocked", action="store_true", help="where the main thread waited, by its frames")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (sizes symbolic)")
    parser.add_argument("--callers", default=None, help="with --cprofile: the callers of functions matching this")
    args = parser.parse_args()
    cpu_rows = thread_cpu() if args.thread_cpu else None
    from triton import knobs

    compiles = []  # whether each Triton compile in this process hit the cache (a worker's are not seen)
    knobs.compilation.listener = lambda **kw: compiles.append(kw["cache_hit"])
    name, first_call = (training_step if args.train else inference_call)(args.case, args.mode, args.dynamic or None)
    with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        torch.cuda.synchronize()
        profiler = cProfile.Profile() if args.cprofile else None
        timeline = CpuTimeline() if args.cpu_timeline else None
        blocked = BlockedSampler() if args.blocked else None
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        first_call()
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        print(f"{name}: cold first call {time.perf_counter() - t0:.2f} s{' (under cProfile)' if profiler else ''}")
        if timeline:
            timeline.stop()
            timeline.print()
        if blocked:
            blocked.stop()
            blocked.print(args.top)
    print(torchweld.compile_times("str"))
    hits = sum(compiles)
    print(f"Triton compiles in this process: {len(compiles)}, of which cache hits {hits}")
    if cpu_rows is not None:
        print(f"\n{'thread':20s} {'phase':44s} {'calls':>5s} {'wall s':>7s} {'CPU s':>7s}")
        for (thread, name), (calls, wall, cpu) in cpu_rows.items():
            print(f"{thread:20s} {name:44s} {calls:5d} {wall:7.3f} {cpu:7.3f}")
    for key in ("cumulative", "tottime") if profiler else ():
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
        text = out.getvalue()
        print(f"\n-- by {key}\n" + text[text.index("ncalls"):])
    if profiler and args.callers:
        pstats.Stats(profiler).print_callers(args.callers)


def inference_call(case: str, mode: str | None, dynamic: bool | None):
    """(row name, the first call of the compiled model under no_grad)."""
    [(name, make)] = cases({case})
    fn, x = make()

    def call():
        with torch.no_grad():
            torchweld.compile(fn, backend="weld", mode=mode, dynamic=dynamic)(x)

    return name, call


def training_step(case: str, mode: str | None, dynamic: bool | None):
    """(row name, compare.py's first training step with the model compiled)."""
    [(name, make_model, make_batch, loss_fn)] = [row for row in training_cases(False, "cuda")
                                                  if row[0].split()[0] == case]
    model = make_model().cuda().train()
    x, y = (t.cuda() for t in make_batch())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        compiled = torchweld.compile(model, backend="weld", mode=mode, dynamic=dynamic)
        opt.zero_grad(True)
        loss_fn(compiled(x), y).backward()
        opt.step()

    return f"{name} train step", step


if __name__ == "__main__":
    main()
