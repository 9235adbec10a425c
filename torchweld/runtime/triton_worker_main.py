"""A Triton compile worker: a separate process that compiles kernels into Triton's disk cache.

Started by `triton_workers.WorkerPool` as `python <this file> --niceness N` (torchweld imports
it only for `binary_of`, which its in-process compiles use too): it imports Triton and the
standard library only (no torch, no CUDA context), so it starts in well under a second. Triton's front end is Python, so
threads in one process compile one kernel at a time; processes compile many.

Started as `python <this file> --fork FD,FD,... --niceness N`, the process imports Triton once and forks
one worker per pair of descriptors (triton_workers.WorkerPool does this: sixteen processes
each importing Triton at once took CPU time from the parent's capture on the H100 host).

Protocol, over stdin/stdout (a forked worker's pair of descriptors): each message is a
4-byte little-endian length and a pickle. The first request is `sys.path` (a list; the
first process's only one where it forks); then each request is `(job_id, request)` and
each reply `(job_id, ok, value)`, where a failed request's value is its error as text.
A request:

    ("compile", module_name, module_path, fn_name, specialization_data, target, triton_env, install_key)

`specialization_data` is what Triton's JIT serializes for a kernel it was about
to compile (`knobs.runtime.jit_cache_hook`, the form `JITFunction.preload`
reads), or what the parent writes in that form (triton_workers.written_specialization);
`target` is (backend, arch, warp_size); `triton_env` the parent's
TRITON_* variables, which choose the cache directory; `install_key` the parent's
`triton.runtime.cache.triton_key()` (or None), which this process, running the same
Triton, would otherwise compute by hashing libtriton.so. The worker compiles the
same source with the same options into Triton's cache, and replies
`{"seconds": ..., "binary": ...}`:
- "seconds": what each step took, {"import": s, "kernel": s}, plus, where Triton's
  compile listener reports them, "ir_init" (its front end) and "stage.<ir>" for each
  stage (ttir, ttgir, llir, ptx, cubin);
- "binary": the compiled kernel as the parent launches it, {"name", "cubin", and the
  launch metadata (BINARY_METADATA)}, or None where Triton made no cubin. The parent
  loads that cubin itself instead of compiling the kernel again out of the cache
  (~25 ms of Python under its GIL a kernel).
("ping",) replies "pong".
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import struct
import sys
import time


def read_message(stream):
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack("<I", header)
    return pickle.loads(stream.read(size))


def write_message(stream, value) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


_modules: dict[str, object] = {}


def _kernel_module(name: str, path: str):
    """The generated kernel module, under the parent's module name (part of each kernel's identity)."""
    module = _modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[name] = module
    return module


def _set_triton_env(env: dict[str, str]) -> None:
    """The parent's TRITON_* variables, but for TRITON_INTERPRET: a worker compiles, it never interprets."""
    env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    for key in [k for k in os.environ if k.startswith("TRITON_") and k not in env]:
        del os.environ[key]
    os.environ.update(env)


# What the parent needs to know of a compiled kernel to launch it (triton_launch.handle_from_binary)
BINARY_METADATA = ("shared", "num_warps", "num_ctas", "launch_cooperative_grid", "launch_pdl", "tensordesc_meta",
                   "global_scratch_size", "profile_scratch_size")


def compile_kernel(module_name: str, module_path: str, fn_name: str, specialization_data: str,
                   target: tuple, triton_env: dict[str, str], install_key: str | None = None) -> dict:
    """What `JITFunction.preload(specialization_data)` compiles, for an explicit target."""
    start = time.perf_counter()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    _set_triton_env(triton_env)
    _adopt_install_key(install_key)
    fn = getattr(_kernel_module(module_name, module_path), fn_name)
    seconds = {"import": time.perf_counter() - start}
    data = json.loads(specialization_data)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
        else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {key: tuple(value) if isinstance(value, list) else value for key, value in data["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()}
    target = GPUTarget(*target)
    options = make_backend(target).parse_options(options)
    source = ASTSource(fn, signature, constexprs, attrs)
    start = time.perf_counter()
    stages = _stage_times()
    kernel = triton.compile(source, target=target, options=options.__dict__)
    seconds["kernel"] = time.perf_counter() - start
    seconds.update(stages)
    return {"seconds": seconds, "binary": binary_of(kernel)}


def binary_of(kernel) -> dict | None:
    """The kernel's name, cubin and launch metadata, or None (no cubin: another backend)."""
    cubin = kernel.asm.get("cubin") if hasattr(kernel.asm, "get") else None
    if not isinstance(cubin, bytes):
        return None
    metadata = {key: getattr(kernel.metadata, key) for key in BINARY_METADATA if hasattr(kernel.metadata, key)}
    return {"name": kernel.name, "cubin": cubin, **metadata}


def _adopt_install_key(key: str | None) -> None:
    """Use the parent's Triton install key instead of hashing libtriton.so here (the same
    files: a worker runs the parent's Python on the parent's sys.path)."""
    if key is None:
        return
    from triton.runtime import cache

    own = getattr(cache, "triton_key", None)
    if own is not None and getattr(own, "torchweld_adopted", None) != key:
        adopted = functools.lru_cache()(lambda: key)
        adopted.torchweld_adopted = key
        cache.triton_key = adopted


def _stage_times() -> dict[str, float]:
    """Filled with the seconds of each step of the next compile (Triton's listener, where
    this Triton reports times): the front end (`ir_init`: source to its first IR) and each stage."""
    from triton import knobs

    stages: dict[str, float] = {}

    def listener(*, times=None, **_):
        if times is None:
            return
        stages["ir_init"] = times.ir_initialization / 1e6
        for name, us in times.lowering_stages:
            stages[f"stage.{name}"] = us / 1e6

    knobs.compilation.listener = listener
    return stages


def _import_compiler() -> None:
    try:
        import triton.compiler.code_generator  # noqa: F401
        from triton.compiler import make_backend  # noqa: F401
    except Exception:  # noqa: BLE001 - the first compile request reports it
        pass


# Workers run at a lower priority than the parent: one per core, they would otherwise take CPU
# time from the parent's threads that render the kernels they are waiting for (lowering,
# rendering and loading on the main thread ran at ~40% of a core during densenet121's cold
# training step on the H100 host). The parent passes config.worker_niceness
# (TORCHWELD_WORKER_NICENESS) as `--niceness N`; 0: the parent's priority.
NICENESS = 10


def _argument(name: str) -> str | None:
    """The value after `name` on this process's command line, or None."""
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args[:-1] else None


def _lower_priority() -> None:
    try:
        os.nice(int(_argument("--niceness") or NICENESS))
    except (OSError, ValueError, AttributeError):  # not permitted, or no nice() here (Windows)
        pass


def fork_workers(fds: list[int], stdout) -> tuple:
    """In the first process (`--fork`), after its imports: fork one worker per pair of
    descriptors the parent passed (its request pipe's read end, its reply pipe's write end),
    which serves on them; this process tells the parent their pids (a list, on `stdout`),
    reaps them as they exit and exits. Returns, in each worker, its (requests, replies) streams."""
    pairs = list(zip(fds[::2], fds[1::2]))
    pids = []
    for requests, replies in pairs:
        pid = os.fork()
        if pid == 0:
            os.dup2(requests, 0)
            os.dup2(replies, 1)
            for fd in fds:  # every other worker's pipes too: a dead worker's reply pipe must reach EOF
                os.close(fd)
            return os.fdopen(0, "rb", closefd=False), os.fdopen(1, "wb", closefd=False)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    write_message(stdout, pids)
    for _ in pids:
        try:
            os.wait()
        except ChildProcessError:
            break
    sys.exit(0)


def main() -> None:
    _lower_priority()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever a compile prints must not corrupt the replies
    os.environ.pop("TRITON_INTERPRET", None)  # read when triton is imported
    path = read_message(stdin)
    if path is None:
        return
    sys.path[:] = path
    _import_compiler()  # now, while the parent is still lowering its graph, not on the first request
    fork = _argument("--fork")
    if fork is not None:
        stdin, stdout = fork_workers([int(fd) for fd in fork.split(",")], stdout)
    while True:
        message = read_message(stdin)
        if message is None:
            return
        job_id, request = message
        try:
            if request[0] == "ping":
                reply = (job_id, True, "pong")
            elif request[0] == "compile":
                reply = (job_id, True, compile_kernel(*request[1:]))
            else:
                reply = (job_id, False, f"unknown request {request[0]!r}")
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
            reply = (job_id, False, f"{type(e).__name__}: {e}")
        write_message(stdout, reply)


if __name__ == "__main__":
    main()
