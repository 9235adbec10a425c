"""Cache entries (torchweld/disk_cache.py) and where they live (torchweld/cache_root.py),
in this process with fake builds; tests/runtime/test_cache_healing.py damages real
caches in processes of their own."""
import errno
import logging
import os

import pytest

from torchweld import cache_root, config, disk_cache


@pytest.fixture
def cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    cache_root.forget()
    caplog.set_level(logging.WARNING, logger="torchweld.cache")
    yield tmp_path / "cache"
    cache_root.forget()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torchweld.cache"]


class FakeBuild:
    """A `build` for disk_cache.library that writes `content` and counts its calls."""

    def __init__(self, content: bytes = b"\x7fELF a library"):
        self.content = content
        self.calls = 0

    def __call__(self, path: str) -> None:
        self.calls += 1
        with open(path, "wb") as f:
            f.write(self.content)


# -- sources ---------------------------------------------------------------------
def test_a_source_is_written_once_and_rewritten_where_it_differs(cache, caplog):
    path = disk_cache.write_source("cpp", "k1.cpp", "int x;\n")
    assert open(path).read() == "int x;\n" and path.startswith(str(cache))
    mtime = os.stat(path).st_mtime_ns
    assert disk_cache.write_source("cpp", "k1.cpp", "int x;\n") == path
    assert os.stat(path).st_mtime_ns == mtime and not warnings_of(caplog)
    with open(path, "w") as f:
        f.write("garbage")
    assert open(disk_cache.write_source("cpp", "k1.cpp", "int x;\n")).read() == "int x;\n"
    assert len(warnings_of(caplog)) == 1 and "k1.cpp is damaged" in warnings_of(caplog)[0]


def test_files_are_written_as_ordinary_files_under_the_umask(cache):
    old = os.umask(0o022)
    try:
        disk_cache._umask_value.clear()
        source = disk_cache.write_source("cpp", "k2.cpp", "int y;\n")
        lib, _ = disk_cache.library("cpp", "k2.so", "k2", FakeBuild())
    finally:
        os.umask(old)
        disk_cache._umask_value.clear()
    assert os.stat(source).st_mode & 0o777 == 0o644
    assert os.stat(lib).st_mode & 0o777 == 0o755
    assert not [name for name in os.listdir(cache / "cpp") if name.endswith(".tmp")]


# -- libraries -------------------------------------------------------------------
# -- compiled Python -------------------------------------------------------------
def test_compiled_code_is_kept_and_a_damaged_entry_compiled_again(cache, caplog, monkeypatch):
    """A generated module compiles once: a second process (here: a second call) loads its code
    object, compile() not called; a damaged entry is compiled again with one warning."""
    import builtins

    source = "def f(x):\n    return x * 2 + 1\n"
    first = disk_cache.compiled_code(source, "/gen/w1.py")
    calls = []
    real_compile = builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda *a, **k: calls.append(a[1]) or real_compile(*a, **k))
    again = disk_cache.compiled_code(source, "/gen/w1.py")
    assert calls == [] and again.co_filename == "/gen/w1.py"
    namespace: dict = {}
    exec(again, namespace)
    assert namespace["f"](3) == 7 and first.co_consts == again.co_consts
    [entry] = [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n.endswith(".bin")]
    with open(entry, "r+b") as f:
        f.seek(12)
        f.write(b"\xff")
    namespace = {}
    exec(disk_cache.compiled_code(source, "/gen/w1.py"), namespace)
    assert namespace["f"](3) == 7 and calls == ["/gen/w1.py"]
    assert len(warnings_of(caplog)) == 1 and "is damaged" in warnings_of(caplog)[0]
    disk_cache.compiled_code(source, "/gen/w2.py")  # another file: another entry (its code names its file)
    assert calls == ["/gen/w1.py", "/gen/w2.py"]


def test_a_library_is_built_once_and_sealed(cache, caplog):
    build = FakeBuild()
    path, built = disk_cache.library("cpp", "k3.so", "key3", build)
    assert built and build.calls == 1
    data = open(path, "rb").read()
    assert data.startswith(build.content) and data[len(build.content):].startswith(disk_cache.SEAL)
    assert disk_cache.library("cpp", "k3.so", "key3", build) == (path, False)
    assert build.calls == 1 and not warnings_of(caplog)


@pytest.mark.parametrize("damage", [
    lambda data: data[:10],  # truncated
    lambda data: b"",  # empty
    lambda data: os.urandom(len(data)),  # garbage
    lambda data: data[:5] + b"X" + data[6:],  # one byte changed
])
def test_a_damaged_library_is_built_again_with_one_warning(cache, caplog, damage):
    build = FakeBuild()
    path, _ = disk_cache.library("cpp", "k4.so", "key4", build)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    assert disk_cache.library("cpp", "k4.so", "key4", build) == (path, True)
    assert open(path, "rb").read() == data and build.calls == 2
    assert len(warnings_of(caplog)) == 1 and "k4.so is damaged" in warnings_of(caplog)[0]


def test_another_entrys_library_is_not_loaded_in_its_place(cache, caplog):
    """The seal covers the key in the name: a sound library under another entry's name is refused."""
    other, _ = disk_cache.library("cpp", "k5.so", "key5", FakeBuild(b"library five"))
    path = os.path.join(os.path.dirname(other), "k6.so")
    with open(other, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    build = FakeBuild(b"library six")
    assert disk_cache.library("cpp", "k6.so", "key6", build) == (path, True)
    assert "seal does not match" in warnings_of(caplog)[0]


def test_a_library_that_will_not_open_is_built_again_once(cache, caplog):
    build = FakeBuild()
    disk_cache.library("cpp", "k7.so", "key7", build)
    opened = []

    def open_library(path):
        opened.append(path)
        if len(opened) == 1:
            raise OSError("undefined symbol: kernel0")
        return "library"

    assert disk_cache.load_library("cpp", "k7.so", "key7", build, open_library) == "library"
    assert build.calls == 2 and len(opened) == 2
    assert "does not load (undefined symbol" in warnings_of(caplog)[0]


def test_a_library_just_built_that_will_not_open_raises(cache):
    def open_library(path):
        raise OSError("undefined symbol: kernel0")

    with pytest.raises(OSError, match="undefined symbol"):
        disk_cache.load_library("cpp", "k8.so", "key8", FakeBuild(), open_library)


def test_another_users_file_is_not_loaded(cache, caplog, monkeypatch):
    build = FakeBuild()
    path, _ = disk_cache.library("cpp", "k9.so", "key9", build)
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:4], 4242, *real_fstat(fd)[5:])))
    assert disk_cache.library("cpp", "k9.so", "key9", build)[1]  # refused: built again
    assert "another user (uid 4242)" in warnings_of(caplog)[0]
    with config.patch(cache_trust_other_users=True):
        assert disk_cache.library("cpp", "k9.so", "key9", build) == (path, False)


# -- where entries live -----------------------------------------------------------
def test_an_empty_cache_dir_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(config, "cache_dir", "")
    cache_root.forget()
    try:
        assert cache_root.configured_root() == str(tmp_path / "home" / ".cache" / "torchweld")
    finally:
        cache_root.forget()


def test_no_home_directory_uses_a_private_cache_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(config, "cache_dir", "")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # HOME unset, no password entry
    caplog.set_level(logging.WARNING, logger="torchweld.cache")
    cache_root.forget()
    try:
        assert cache_root.configured_root() is None
        folder = cache_root.writable_folder("cpp")
        assert folder.startswith(cache_root.private_root()) and cache_root.folders("cpp") == [folder]
        cache_root.writable_folder("guards")
        assert len(warnings_of(caplog)) == 1 and "HOME is unset" in warnings_of(caplog)[0]
    finally:
        cache_root.forget()


def test_a_cache_dir_that_cannot_be_made_uses_a_private_cache(monkeypatch, tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "a_file" / "cache"))
    caplog.set_level(logging.WARNING, logger="torchweld.cache")
    cache_root.forget()
    try:
        path = disk_cache.write_source("wrappers", "w1.py", "x = 1\n")
        assert path.startswith(cache_root.private_root())
        assert len(warnings_of(caplog)) == 1 and "Not a directory" in warnings_of(caplog)[0]
    finally:
        cache_root.forget()


def test_another_users_cache_dir_is_used_only_when_trusted(cache, caplog, monkeypatch):
    os.makedirs(cache)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert cache_root.configured_root() is None
    assert "belongs to another user" in warnings_of(caplog)[0]
    cache_root.forget()
    with config.patch(cache_trust_other_users=True):
        assert cache_root.configured_root() == str(cache)


def test_a_refused_write_sends_new_entries_to_the_private_cache_and_keeps_reading(cache, caplog):
    kept = disk_cache.write_source("cpp", "k10.cpp", "kept\n")
    folder = cache_root.writable_folder("cpp")
    assert cache_root.refused(folder, PermissionError(errno.EACCES, "Permission denied"))
    assert cache_root.refused(folder, PermissionError(errno.EACCES, "Permission denied"))  # said once
    assert cache_root.writable_folder("cpp").startswith(cache_root.private_root())
    assert disk_cache.write_source("cpp", "k10.cpp", "kept\n") == kept  # still read where it is
    assert disk_cache.write_source("cpp", "k11.cpp", "new\n").startswith(cache_root.private_root())
    assert len(warnings_of(caplog)) == 1 and "Permission denied" in warnings_of(caplog)[0]


def test_a_cache_deleted_while_running_is_made_again(cache, caplog):
    import shutil

    disk_cache.write_source("cpp", "k12.cpp", "first\n")
    shutil.rmtree(cache)
    path = disk_cache.write_source("cpp", "k13.cpp", "second\n")
    assert path.startswith(str(cache)) and open(path).read() == "second\n"
    assert len(warnings_of(caplog)) == 1 and "deleted" in warnings_of(caplog)[0]
