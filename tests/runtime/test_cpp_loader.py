"""Building generated C++ (torchweld/runtime/cpp_loader.py)."""
import threading

import pytest

from torchweld import config
from torchweld.runtime import cpp_loader


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache of the test's own, and a compiler `which` finds (compile_once is faked)."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(cpp_loader.shutil, "which", lambda name: name)


def test_threads_build_different_sources_at_once(monkeypatch, cache):
    """A training step's forward and its backward (compiled ahead in a thread) build at the
    same time: each waits here for the other to be inside the compiler as well."""
    both_inside = threading.Barrier(2, timeout=20)

    def compile_once(command, target, error):
        both_inside.wait()  # raises BrokenBarrierError if the builds ran one after the other
        open(target, "w").close()
        return target

    monkeypatch.setattr(cpp_loader, "compile_once", compile_once)
    results, errors = [], []

    def build(source):
        try:
            results.append(cpp_loader.build(source))
        except threading.BrokenBarrierError as e:
            errors.append(e)

    threads = [threading.Thread(target=build, args=(f"// kernel {i}\n",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 2


def test_one_source_is_built_once_by_threads_asking_together(monkeypatch, cache):
    import os
    import time

    calls = []

    def compile_once(command, target, error):  # as the real one: nothing to do once target exists
        if not os.path.exists(target):
            calls.append(target)
            time.sleep(0.05)  # the others ask meanwhile
            open(target, "w").close()
        return target

    monkeypatch.setattr(cpp_loader, "compile_once", compile_once)
    threads = [threading.Thread(target=cpp_loader.build, args=("// the same\n",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(cpp_loader.shutil, "which", lambda name: None)
    with pytest.raises(cpp_loader.CppCompileError, match="no C\\+\\+ compiler"):
        cpp_loader.build("// never built\n")
