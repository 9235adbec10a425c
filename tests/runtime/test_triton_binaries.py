"""Triton kernels' binaries kept in the disk cache (runtime/triton_binaries.py): what names an
entry, damage, and (CUDA) a second process that loads its kernels without compiling them."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchweld import cache_root, config
from torchweld.runtime.triton_launch import CompileJob

pytest.importorskip("triton")


@pytest.fixture
def cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cache_root.forget()
    caplog.set_level(logging.WARNING, logger="torchweld.cache")
    yield tmp_path / "cache"
    cache_root.forget()


def job(source="@triton.jit\ndef k(x): pass\n", config=(("XBLOCK", 128), ("num_warps", 4)), device="cuda:0",
        aligned=(True,)):
    return CompileJob(source, None, (torch.float32,), aligned, config, torch.device(device), (17,))


BINARY = {"name": "k_0", "cubin": bytes(range(256)) * 3, "shared": 0, "num_warps": 4, "num_ctas": 1,
          "launch_cooperative_grid": False, "launch_pdl": False, "tensordesc_meta": None,
          "global_scratch_size": 0, "profile_scratch_size": 0}


def test_a_binary_is_kept_under_everything_it_is_made_from(cache, monkeypatch):
    from torchweld.runtime import triton_binaries

    assert triton_binaries.stored(job()) is None
    triton_binaries.store(job(), BINARY)
    assert triton_binaries.stored(job()) == BINARY
    for other in (job(source="@triton.jit\ndef k(y): pass\n"), job(config=(("XBLOCK", 64), ("num_warps", 4))),
                  job(aligned=(False,)), job(device="cpu")):
        assert triton_binaries.stored(other) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # another GPU
    assert triton_binaries.stored(job()) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")  # where Triton keeps its own: not what is compiled
    assert triton_binaries.stored(job()) == BINARY
    from triton import knobs

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # (restored after the test: the knob writes it)
    knobs.language.default_fp_fusion = False  # a knob a program sets in code
    assert triton_binaries.stored(job()) is None
    knobs.language.default_fp_fusion = True
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    assert triton_binaries.stored(job()) == BINARY
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # a setting of the compile
    assert triton_binaries.stored(job()) is None


def test_a_damaged_binary_is_compiled_again_with_one_warning(cache, caplog):
    from torchweld.runtime import triton_binaries

    triton_binaries.store(job(), BINARY)
    [path] = [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n.endswith(".json")]
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"!")
    assert triton_binaries.stored(job()) is None
    assert len([r for r in caplog.records if "is damaged" in r.getMessage()]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need CUDA")
def test_a_second_process_loads_its_kernels_without_compiling_them(tmp_path):
    """The first process compiles (and keeps) its kernels; a second, with the same torchweld
    cache but an empty Triton cache and the graph cache off, loads every kernel from its kept
    binary: no compile worker, no Triton compile, and the same results."""
    script = textwrap.dedent("""
        import json, sys, torch, torchweld
        from torchweld import timing
        def f(x, y):
            return (torch.sin(x) * y).sum(-1), torch.relu(x - y).amax(0)
        x, y = torch.randn(64, 300, device="cuda"), torch.randn(64, 300, device="cuda")
        got = torchweld.compile(f, backend="weld")(x, y)
        want = f(x, y)
        ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
        phases = [name for name in timing.snapshot() if "triton_compile.workers" in name or "threads.kernel" in name]
        print(json.dumps({"ok": ok, "compiled": phases}))
    """)
    env = dict(os.environ, TORCHWELD_CACHE_DIR=str(tmp_path / "weld"), TORCHWELD_GRAPH_CACHE="0")
    runs = []
    for n in range(2):
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton{n}")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        runs.append(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["ok"] and runs[1]["ok"]
    assert runs[0]["compiled"] and not runs[1]["compiled"], runs
