"""fake_memo_disk keeps fake_memo's results from one process to the next (with the graph
cache on): a capture in a fresh process replays them instead of dispatching; a damaged
file is deleted with a warning and never fails a compile."""
import glob
import logging
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torchweld
from torchweld import cache_root, config, fake_memo, fake_memo_disk


@pytest.fixture
def cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "graph_cache", True)
    monkeypatch.setattr(fake_memo_disk, "_loaded", False)
    cache_root.forget()
    fake_memo.forget()
    caplog.set_level(logging.WARNING, logger="torchweld.cache")
    yield tmp_path / "cache"
    cache_root.forget()
    fake_memo.forget()


def a_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), torch.nn.LayerNorm(16))


def count_dispatches(monkeypatch) -> list:
    dispatched = []
    original = FakeTensorMode.__torch_dispatch__
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__",
                        lambda self, *a, **k: dispatched.append(a[0]) or original(self, *a, **k))
    return dispatched


def test_a_capture_in_a_fresh_process_replays_the_results_on_disk(cache, monkeypatch):
    model, x = a_model(), torch.randn(4, 8)
    compiled = torchweld.compile(model, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))
    files = glob.glob(os.path.join(cache, "fake_results", "*.pickle"))
    assert len(files) == 1
    # a fresh process: nothing in memory, the file read before its first capture
    torchweld.reset()
    monkeypatch.setattr(fake_memo_disk, "_loaded", False)
    dispatched = count_dispatches(monkeypatch)
    compiled = torchweld.compile(model, backend="eager")
    for scale in (1.0, 2.0):  # computed as eager does, call after call
        torch.testing.assert_close(compiled(x * scale), model(x * scale))
    memoized = [op for op in dispatched if fake_memo._kind(op) is not None]
    assert memoized == [], memoized
    # then what the file cannot know: another batch (a first sight, dispatched), a weight written
    # in place, a module setting changed (a recompile): each call as eager's
    wider = torch.randn(7, 8)
    torch.testing.assert_close(compiled(wider), model(wider))
    with torch.no_grad():
        model[0].weight.mul_(-1.5)
    torch.testing.assert_close(compiled(x), model(x))
    model[2].eps = 0.5
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(wider), model(wider))


def test_a_damaged_file_is_deleted_with_a_warning_and_written_again(cache, caplog):
    model, x = a_model(), torch.randn(4, 8)
    torch.testing.assert_close(torchweld.compile(model, backend="eager")(x), model(x))
    (path,) = glob.glob(os.path.join(cache, "fake_results", "*.pickle"))
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"garbage")
    torchweld.reset()
    fake_memo_disk._loaded = False
    torch.testing.assert_close(torchweld.compile(model, backend="eager")(x), model(x))
    assert any("is damaged" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert fake_memo_disk._read(fake_memo_disk._file_key())  # written again, whole


def test_nothing_is_written_with_the_graph_cache_off(cache, monkeypatch):
    monkeypatch.setattr(config, "graph_cache", False)
    model, x = a_model(), torch.randn(4, 8)
    torch.testing.assert_close(torchweld.compile(model, backend="eager")(x), model(x))
    assert not glob.glob(os.path.join(cache, "fake_results", "*"))


def test_a_file_that_does_not_unpickle_is_ignored(cache, caplog):
    key = fake_memo_disk._file_key()
    from torchweld import disk_cache

    disk_cache.write_sealed(fake_memo_disk.KIND, fake_memo_disk._name(key), key, b"not a pickle")
    assert fake_memo_disk._read(key) == {}
    assert any("does not unpickle" in r.getMessage() for r in caplog.records)
    model, x = a_model(), torch.randn(4, 8)
    torch.testing.assert_close(torchweld.compile(model, backend="eager")(x), model(x))


def test_a_refused_write_is_a_warning_not_a_failed_compile(cache, caplog, monkeypatch):
    from torchweld import disk_cache

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_cache, "write_sealed", refuse)
    model, x = a_model(), torch.randn(4, 8)
    compiled = torchweld.compile(model, backend="eager")
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    assert any("could not be written" in r.getMessage() for r in caplog.records)
