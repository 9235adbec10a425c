"""Building generated C++ (torchweld/runtime/cpp_loader.py)."""
import threading

import pytest

from torchweld import cache_root, config
from torchweld.runtime import cpp_loader


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache of the test's own, and a compiler `which` finds (the compile is faked)."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(cpp_loader.shutil, "which", lambda name: name)
    cache_root.forget()
    yield tmp_path
    cache_root.forget()


def fake_compiler(monkeypatch, compile_into):
    """cpp_loader's compiler replaced: `compile_into(path)` writes the library."""
    monkeypatch.setattr(cpp_loader, "compiler_build", lambda command, error: compile_into)


def test_threads_build_different_sources_at_once(monkeypatch, cache):
    """A training step's forward and its backward (compiled ahead in a thread) build at the
    same time: each waits here for the other to be inside the compiler as well."""
    both_inside = threading.Barrier(2, timeout=20)

    def compile_into(path):
        both_inside.wait()  # raises BrokenBarrierError if the builds ran one after the other
        open(path, "wb").close()

    fake_compiler(monkeypatch, compile_into)
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
    import time

    calls = []

    def compile_into(path):
        calls.append(path)
        time.sleep(0.05)  # the others ask meanwhile
        open(path, "wb").close()

    fake_compiler(monkeypatch, compile_into)
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


def test_the_key_holds_the_cpu_that_native_stands_for(monkeypatch):
    """Two machines whose compilers resolve -march=native differently never share a library."""
    monkeypatch.setattr(cpp_loader, "native_target", lambda cxx: "x86_64 -march=skylake -mavx2")
    skylake = cpp_loader.library_key("// a kernel\n")
    monkeypatch.setattr(cpp_loader, "native_target", lambda cxx: "x86_64 -march=znver3 -mavx2")
    assert cpp_loader.library_key("// a kernel\n") != skylake


def test_a_cache_that_cannot_be_written_at_all_is_a_compile_error(monkeypatch, cache):
    """The weld backend runs a graph eagerly on a CppCompileError (with its message), so an
    OSError of the cache (here: the private directory refusing too) must become one."""
    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cpp_loader, "write_source", lambda kind, name, text: refuse(name))
    with pytest.raises(cpp_loader.CppCompileError, match="Permission denied"):
        cpp_loader.build("// cannot be written\n")
