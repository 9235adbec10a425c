"""Triton compile worker processes (runtime/triton_workers.py, triton_worker_main.py).

The pool's protocol and failure handling run anywhere; a worker compiles a kernel
for an H100 target on the CPU too (Triton ships ptxas). That the parent then
finds each kernel in the cache instead of compiling it is checked on CUDA."""
import json
import os
import sys
import textwrap
import time

import pytest
import torch

import torchweld
from torchweld.runtime import triton_worker_main
from torchweld.runtime.triton_workers import WorkerPool, install_key

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compiler"))
from weld_helpers import check  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the parent's cache hits need CUDA")


@pytest.fixture
def pool():
    pool = WorkerPool(2)
    yield pool
    pool.close()


def test_workers_answer_every_request_and_report_errors(pool):
    futures = [pool.submit(("ping",)) for _ in range(12)]
    assert [f.result(timeout=60) for f in futures] == ["pong"] * 12
    with pytest.raises(RuntimeError, match="unknown request 'bogus'"):
        pool.submit(("bogus",)).result(timeout=60)


def test_killed_workers_are_replaced(pool):
    assert pool.submit(("ping",)).result(timeout=60) == "pong"
    killed = list(pool._processes)
    for process in killed:
        process.kill()
        process.wait()
    # the request each dead worker had fails (its kernel is compiled by the parent); the rest are answered
    outcomes = []
    for future in [pool.submit(("ping",)) for _ in range(6)]:
        try:
            outcomes.append(future.result(timeout=60))
        except RuntimeError as e:
            assert "worker exited" in str(e)
            outcomes.append("failed")
    assert outcomes.count("failed") <= 2 and outcomes.count("pong") >= 4
    assert [f.result(timeout=60) for f in [pool.submit(("ping",)) for _ in range(4)]] == ["pong"] * 4
    assert not set(map(id, pool._processes)) & set(map(id, killed))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's parent from /proc")
def test_workers_are_forked_from_one_process_that_imports_triton_once(pool):
    assert [f.result(timeout=60) for f in [pool.submit(("ping",)) for _ in range(4)]] == ["pong"] * 4
    pids = [worker.pid for worker in pool._processes]

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])

    assert len(set(pids)) == 2 and {parent(pid) for pid in pids} == {pool._first.pid}


TRUNCATING_WORKER = """
import struct, sys
sys.stdin.buffer.read(4)  # the start of the sys.path message: enough to know the parent is there
sys.stdout.buffer.write(struct.pack("<I", 1000) + b"not a pickle")
sys.stdout.buffer.flush()
"""


def test_workers_that_keep_dying_fail_requests_instead_of_leaving_them_waiting(tmp_path):
    """Each worker answers with a truncated reply: its request fails, and it is replaced once
    (one replacement per worker); then every request fails at once."""
    script = tmp_path / "truncating_worker.py"
    script.write_text(TRUNCATING_WORKER)
    pool = WorkerPool(1, script=str(script))
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="a Triton compile worker exited"):
                pool.submit(("ping",)).result(timeout=60)
        for future in [pool.submit(("ping",)) for _ in range(3)]:
            with pytest.raises(RuntimeError, match="every Triton compile worker exited"):
                future.result(timeout=60)
    finally:
        pool.close()


def test_closed_pool_refuses_new_work():
    pool = WorkerPool(1)
    pool.close()
    assert all(p.poll() is not None for p in pool._processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(("ping",)).result(timeout=5)


KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def double(ptr0, ptr1, XBLOCK: tl.constexpr):
    x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(ptr1 + x, tl.load(ptr0 + x) * 2.0)
'''


def test_a_worker_compiles_a_kernel_into_the_cache_without_a_gpu(pool, tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "tw_worker_kernel.py"
    path.write_text(textwrap.dedent(KERNEL))
    pointer = [["tt.divisibility", 16]]
    data = json.dumps({
        "name": "tw_worker_kernel.double", "signature": {"ptr0": "*fp32", "ptr1": "*fp32", "XBLOCK": "constexpr"},
        "constant_keys": [[2]], "constant_vals": [128], "attrs_keys": [[0], [1]], "attrs_vals": [pointer, pointer],
        "options": {"num_warps": 4}, "key": "unused",
    })
    cache = tmp_path / "triton-cache"
    env = {"TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1"}
    request = ("compile", "tw_worker_kernel", str(path), "double", data, ("cuda", 90, 32), env, install_key())
    reply = pool.submit(request).result(timeout=300)
    seconds, binary = reply["seconds"], reply["binary"]
    assert {"import", "kernel"} <= set(seconds)
    if "ir_init" in seconds:  # Triton's listener reports its steps: the front end and each stage
        assert "stage.cubin" in seconds
    cubins = [os.path.join(root, name) for root, _, files in os.walk(cache) for name in files if name.endswith(".cubin")]
    assert [os.path.basename(p) for p in cubins] == ["double.cubin"]
    # the binary comes back with what the parent needs to launch it without compiling it again
    assert binary["name"] == "double" and binary["cubin"] == open(cubins[0], "rb").read()
    assert binary["num_warps"] == 4 and binary["num_ctas"] == 1 and isinstance(binary["shared"], int)


def test_a_worker_adopts_the_parents_install_key(monkeypatch):
    """The key Triton hashes from its 500 MB library comes from the parent, so that each
    worker's cache keys are the parent's without hashing it again."""
    cache = pytest.importorskip("triton.runtime.cache")
    if not hasattr(cache, "triton_key"):
        pytest.skip("this Triton keeps its install key elsewhere")
    monkeypatch.setattr(cache, "triton_key", cache.triton_key)  # restored after the test
    triton_worker_main._adopt_install_key("the-parents-key")
    assert cache.triton_key() == "the-parents-key"
    triton_worker_main._adopt_install_key(None)  # an older parent sends none: the worker's own stays
    assert cache.triton_key() == "the-parents-key"


@cuda
def test_the_parent_loads_what_the_workers_compiled(tmp_path, monkeypatch):
    from triton import knobs

    from torchweld.runtime import triton_workers
    from torchweld.tuning import tuning

    if triton_workers.worker_pool() is None:
        pytest.skip("no compile workers for this Triton")
    monkeypatch.setattr(tuning, "workers_from", 1)  # this graph's few kernels go to the workers too
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    hits = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    scale = 1.0 + time.time() % 1  # new kernel text: nothing of this process's compiled already

    def fn(a):
        return torch.softmax(a * scale, -1) + torch.tanh(a).sum()

    from torchweld import timing

    before = timing.snapshot().get("weld.triton_compile.threads.load_binary", (0, 0.0))[0]
    modules_before = {m for m in sys.modules if m.startswith("torchweld_triton_")}
    check(fn, [torch.randn(300, 33, device="cuda")])
    loaded = timing.snapshot().get("weld.triton_compile.threads.load_binary", (0, 0.0))[0] - before
    # each kernel is the binary a worker sent back, loaded as is (Triton 3.6 and weld's own
    # launcher), or Triton's compile here that finds the worker's binary in its cache
    assert loaded or hits, "the workers compiled nothing this graph launches"
    assert all(hits), hits
    if loaded and not hits:  # nothing compiled here: the kernels' modules were never imported either
        assert {m for m in sys.modules if m.startswith("torchweld_triton_")} == modules_before


SPECIALIZED = '''
import triton
import triton.language as tl


@triton.jit
def kernel(ptr0, ptr1, xnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(ptr1 + x, tl.load(ptr0 + x, x < xnumel), x < xnumel)
'''


UNSPECIALIZED = SPECIALIZED.replace("@triton.jit", "@triton.jit(do_not_specialize=['kd0'])").replace(
    "xnumel, XBLOCK", "xnumel, kd0, XBLOCK")


def test_specialization_classes():
    """Triton compiles apart an int of 1, one divisible by 16 and an int64; an argument it
    does not specialize on (a magic number, size_args.packed_division) has its type alone."""
    from torchweld.runtime.triton_launch import specialization_class

    assert specialization_class((1, 32, 33, 2**33, 2**33 + 1)) == (1, 16, 17, 2**32 + 16, 2**32 + 17)
    assert specialization_class((32, 2**33, 2**33 + 1), (False, True, True)) == (16, 2**32 + 17, 2**32 + 17)


@cuda
@pytest.mark.parametrize("source, params, values, unspecialized", [
    (SPECIALIZED, ("ptr0", "ptr1", "xnumel", "XBLOCK", "RBLOCK"), (32,), ()),
    (UNSPECIALIZED, ("ptr0", "ptr1", "xnumel", "kd0", "XBLOCK", "RBLOCK"), (32, 2**32 + 48), (False, True)),
])
def test_the_written_specialization_of_an_unspecialized_argument(tmp_path, source, params, values, unspecialized):
    """A magic-number argument under do_not_specialize: the JIT, called with a value divisible
    by 16, specializes on nothing but its type, as the specialization written from its class."""
    from torchweld.runtime import triton_launch, triton_workers
    from torchweld.runtime.triton_loader import GeneratedKernel

    dtypes, aligned, config = (torch.float32, torch.float32), (True, True), {"XBLOCK": 128, "RBLOCK": 1}
    ints = triton_launch.specialization_class(values, unspecialized)
    names = tuple(p for p, flag in zip(params[len(dtypes):], unspecialized) if flag)
    written = triton_workers.written_specialization(params, dtypes, aligned, ints, config, names)
    if written is None:
        pytest.skip("this Triton's specialization format is not written by weld")
    fn = GeneratedKernel(source.replace("kernel(", f"kernel_{tmp_path.name}("), f"kernel_{tmp_path.name}")
    job = triton_launch.CompileJob(fn.src, fn, dtypes, aligned, tuple(sorted(config.items())),
                                   torch.device("cuda"), values, params)  # the JIT sees the values themselves
    jit = json.loads(triton_workers.specialization_data(fn, triton_launch._dummy_arguments(job), dict(config)))
    written = json.loads(written)
    assert written["signature"] == jit["signature"]
    assert (dict(zip(map(tuple, written["attrs_keys"]), written["attrs_vals"]))
            == dict(zip(map(tuple, jit["attrs_keys"]), jit["attrs_vals"])))


@cuda
@pytest.mark.parametrize("dtypes, aligned, ints, config", [
    ((torch.float32, torch.float32), (True, True), (16,), {"XBLOCK": 128, "RBLOCK": 1, "num_warps": 4}),
    ((torch.float16, torch.bfloat16), (False, True), (17,), {"XBLOCK": 1, "RBLOCK": 1024, "num_warps": 8}),
    ((torch.int64, torch.bool), (True, False), (1,), {"XBLOCK": 256, "RBLOCK": 1}),
    ((torch.uint8, torch.int32), (False, False), (2**31 + 16,), {"XBLOCK": 64, "RBLOCK": 32, "num_warps": 2}),
])
def test_the_written_specialization_is_what_tritons_jit_makes(tmp_path, dtypes, aligned, ints, config):
    """What the parent hands a worker without running Triton's JIT: the JIT's own
    specialization of the same arguments, in the same form."""
    from triton.compiler import make_backend

    from torchweld.runtime import triton_launch, triton_workers
    from torchweld.runtime.triton_loader import GeneratedKernel

    params = ("ptr0", "ptr1", "xnumel", "XBLOCK", "RBLOCK")
    written = triton_workers.written_specialization(params, dtypes, aligned, ints, config)
    if written is None:
        pytest.skip("this Triton's specialization format is not written by weld")
    fn = GeneratedKernel(SPECIALIZED.replace("kernel(", f"kernel_{tmp_path.name}("), f"kernel_{tmp_path.name}")
    job = triton_launch.CompileJob(fn.src, fn, dtypes, aligned, tuple(sorted(config.items())),
                                   torch.device("cuda"), ints, params)
    jit = json.loads(triton_workers.specialization_data(fn, triton_launch._dummy_arguments(job), dict(config)))
    written = json.loads(written)
    assert written["signature"] == jit["signature"]
    for part in ("constant", "attrs"):
        assert (dict(zip(map(tuple, written[f"{part}_keys"]), written[f"{part}_vals"]))
                == dict(zip(map(tuple, jit[f"{part}_keys"]), jit[f"{part}_vals"])))
    backend = make_backend(triton_launch.triton_driver().get_current_target())
    tuples = lambda options: {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}  # noqa: E731
    assert backend.parse_options(tuples(written["options"])) == backend.parse_options(tuples(jit["options"]))


def test_a_generated_kernel_is_imported_when_first_used():
    """Kernels a worker compiles and the parent launches from their binary are never imported
    in the parent; Triton's JIT launch (or any use of the JIT function) imports the module first."""
    from torchweld.runtime.triton_loader import GeneratedKernel

    name = f"k_{time.time_ns()}"
    source = textwrap.dedent(f'''
        class _Launcher:
            def __getitem__(self, grid):
                return lambda *args: ("launched", grid, args)

            def warmup(self, *args, grid):
                return ("compiled", args)


        {name} = _Launcher()
    ''')
    kernel = GeneratedKernel(source, name)
    kernel.written.result()  # written by a background thread
    assert open(kernel.path).read() == kernel.src == source
    from concurrent.futures import Future

    answer = Future()
    chained = kernel.when_written(lambda: answer)  # a worker's compile, asked for once the file is there
    answer.set_result(7)
    assert chained.result(timeout=5) == 7
    with pytest.raises(ZeroDivisionError):
        kernel.when_written(lambda: 1 / 0).result(timeout=5)
    assert kernel.module_name not in sys.modules
    assert kernel[(3,)](1, 2) == ("launched", (3,), (1, 2))
    assert kernel.module_name in sys.modules
    assert kernel.warmup(5, grid=(1,)) == ("compiled", (5,))
    assert GeneratedKernel(source, name).jit_function is kernel.jit_function  # one import per module


def test_the_specialization_hook_skips_only_its_own_threads_compile():
    """The hook that captures a kernel's specialization is global to the process; a compile
    the thread pool runs meanwhile (a kernel handed out before) must go ahead, not come back
    empty (which made weld fall back to Triton's JIT launches for a whole graph)."""
    import threading

    knobs = pytest.importorskip("triton").knobs
    from torchweld.runtime.triton_workers import specialization_data

    seen = {}

    class Kernel:
        def warmup(self, *args, grid, **config):
            hook = knobs.runtime.jit_cache_hook
            other = threading.Thread(target=lambda: seen.update(other=hook(compile={"specialization_data": "x"})))
            other.start()
            other.join()
            seen["own"] = hook(compile={"specialization_data": "ours"})

    assert specialization_data(Kernel(), [], {}) == "ours"
    assert seen == {"other": False, "own": True}


def test_start_in_background_starts_the_pool_once_and_not_when_workers_are_off(monkeypatch):
    import threading

    from torchweld.runtime import triton_workers

    started = threading.Event()
    calls = []
    monkeypatch.setattr(triton_workers, "_pool", None)
    monkeypatch.setattr(triton_workers, "worker_pool", lambda: calls.append(1) or started.set())
    with torchweld.config.patch(compile_workers=0):  # TORCHWELD_COMPILE_WORKERS=0
        triton_workers.start_in_background()
        assert not started.wait(0.2) and calls == []
    with torchweld.config.patch(compile_workers=2):
        triton_workers.start_in_background()
        assert started.wait(5) and calls == [1]


def test_workers_run_at_a_lower_priority_than_the_parent(monkeypatch):
    """One worker per core must not starve the parent's threads that render the kernels they wait for."""
    import subprocess

    from torchweld.runtime.triton_workers import _niceness_arguments

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import triton_worker_main as m; "
            "before = os.nice(0); m._lower_priority(); print(os.nice(0) - before)")
    folder = os.path.dirname(triton_worker_main.__file__)
    raised = subprocess.run([sys.executable, "-c", code, folder, *_niceness_arguments()], capture_output=True,
                            text=True, check=True)
    assert int(raised.stdout) == min(triton_worker_main.NICENESS, 19 - os.nice(0))
    with torchweld.config.patch(worker_niceness=0):  # TORCHWELD_WORKER_NICENESS=0
        same = subprocess.run([sys.executable, "-c", code, folder, *_niceness_arguments()], capture_output=True,
                              text=True, check=True)
    assert int(same.stdout) == 0


def test_the_written_specialization_of_each_argument_kind(monkeypatch):
    """Without a GPU: the form written_specialization writes (the CUDA test above compares it
    with Triton 3.6's JIT), and None for a Triton whose format it does not know."""
    triton = pytest.importorskip("triton")
    from torchweld.runtime import triton_workers

    params = ("ptr0", "ptr1", "ptr2", "xnumel", "XBLOCK", "RBLOCK")
    args = (params, (torch.float32, torch.bool, torch.bfloat16), (True, False, True), (48,),
            {"XBLOCK": 1024, "RBLOCK": 1, "num_warps": 8})
    monkeypatch.setattr(triton_workers, "WRITTEN_FORMAT", ("0", "1"))
    assert triton_workers.written_specialization(*args) is None
    monkeypatch.setattr(triton_workers, "WRITTEN_FORMAT", tuple(triton.__version__.split(".")[:2]))
    data = json.loads(triton_workers.written_specialization(*args))
    assert data["signature"] == {"ptr0": "*fp32", "ptr1": "*u1", "ptr2": "*bf16", "xnumel": "i32",
                                 "XBLOCK": "constexpr", "RBLOCK": "constexpr"}
    divisible = [["tt.divisibility", 16]]
    assert dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"])) == {
        (0,): divisible, (1,): [], (2,): divisible, (3,): divisible}
    assert dict(zip(map(tuple, data["constant_keys"]), data["constant_vals"])) == {(4,): 1024, (5,): 1}
    assert data["options"]["num_warps"] == 8 and "XBLOCK" not in data["options"]
    unspecialized = json.loads(triton_workers.written_specialization(*args, ("xnumel",)))  # do_not_specialize
    assert unspecialized["signature"] == data["signature"]
    assert dict(zip(map(tuple, unspecialized["attrs_keys"]), unspecialized["attrs_vals"])) == {
        (0,): divisible, (1,): [], (2,): divisible}
    assert triton_workers.written_specialization(params[:-1], *args[1:]) is None  # parameters that do not match
    assert triton_workers.written_specialization(params, (torch.complex64,) + args[1][1:], *args[2:]) is None
