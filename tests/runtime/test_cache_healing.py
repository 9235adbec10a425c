"""A damaged disk cache (torchweld/disk_cache.py, torchweld/cache_root.py) never takes a
program down: each damage is followed by a correct run that says what it repaired in one
warning. Every scenario runs in a process of its own (tests/reliability.py): a regression
crashes that process (SIGBUS in dlopen, SIGSEGV), not pytest."""
import os
import shutil

import pytest

from tests.reliability import (
    DAMAGES, badly_sealed, environment, libraries, read_only, run_concurrently, run_program, unwritable_home)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache filled once for the module with the first function's kernel and the guard evaluator."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    outcome = run_program(cache, "first")
    assert outcome.ok and not outcome.warnings, outcome.describe()
    return cache


def copy_of(filled, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    return cache


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_entry_is_built_again_with_one_warning(filled, tmp_path, name):
    damage = DAMAGES[name]
    cache = copy_of(filled, tmp_path)
    damage.apply(cache)
    outcome = run_program(cache, "first")
    assert outcome.ok, outcome.describe()
    assert len(outcome.warnings) == damage.entries, outcome.stderr
    assert all("cache entry" in line for line in outcome.warnings)
    assert not badly_sealed(cache)  # repaired in place: the next process loads it without a word
    assert not any("this is not C++" in p.read_text() for p in cache.glob("cpp/*.cpp"))
    assert not any("garbage(" in p.read_text() for p in cache.glob("wrappers/*.py"))


def test_the_cache_deleted_while_the_program_runs(tmp_path):
    outcome = run_program(tmp_path / "cache", "delete")
    assert outcome.ok, outcome.describe()
    assert len(outcome.warnings) == 1 and "deleted" in outcome.warnings[0]
    assert libraries(tmp_path / "cache", "cpp")  # made again, and the second function's kernel in it


def test_a_read_only_cache_still_serves_and_new_kernels_go_elsewhere(filled, tmp_path):
    cache = copy_of(filled, tmp_path)
    before = sorted(p.name for p in cache.rglob("*"))
    with read_only(cache) as prefix:
        if prefix is None:
            pytest.skip("no way to make a directory read-only for root here (unshare --mount)")
        outcome = run_program(cache, prefix=prefix)
    assert outcome.ok, outcome.describe()
    assert len(outcome.warnings) == 1 and "cannot write to the cache directory" in outcome.warnings[0]
    assert sorted(p.name for p in cache.rglob("*")) == before


def test_an_unwritable_home_without_a_cache_dir(tmp_path):
    home = unwritable_home()
    try:
        outcome = run_program(None, env=environment(None, HOME=str(home)), cwd=tmp_path)
    finally:
        home.unlink()
    assert outcome.ok, outcome.describe()
    assert len(outcome.warnings) == 1 and "cannot use the cache directory" in outcome.warnings[0]
    assert not list(tmp_path.iterdir())


def test_an_empty_cache_dir_means_the_default(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    outcome = run_program("", env=environment("", HOME=str(home)), cwd=cwd)
    assert outcome.ok and not outcome.warnings, outcome.describe()
    assert not list(cwd.iterdir())  # not the current directory
    assert libraries(home / ".cache" / "torchweld", "cpp")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the cache to another user needs root (chown)")
def test_another_users_cache_is_loaded_only_when_trusted(filled, tmp_path):
    import pwd

    cache = copy_of(filled, tmp_path)
    other = pwd.getpwnam("nobody").pw_uid
    for path in [cache, *cache.rglob("*")]:
        os.chown(path, other, -1)
    outcome = run_program(cache)
    assert outcome.ok, outcome.describe()
    assert len(outcome.warnings) == 1 and "belongs to another user" in outcome.warnings[0]
    assert len(libraries(cache, "cpp")) == 1  # nothing written there
    trusted = run_program(cache, env=environment(cache, TORCHWELD_CACHE_TRUST_OTHER_USERS="1"))
    assert trusted.ok and not trusted.warnings, trusted.describe()


def test_processes_compiling_into_one_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    outcomes = run_concurrently(cache, processes=3)
    for outcome in outcomes:
        assert outcome.ok and not outcome.warnings, outcome.describe()
    assert len(libraries(cache, "cpp")) == 2 and len(libraries(cache, "guards")) == 1
    assert not badly_sealed(cache)
    assert not list(cache.rglob("*.tmp"))


def test_c_helpers_are_built_once_per_machine_not_per_cache_dir(tmp_path):
    """A process with a new cache directory finds the guard evaluator in the helpers directory
    (config.helpers_dir) instead of building it again; kernels still go to its cache directory."""
    helpers = tmp_path / "helpers"
    first, second = tmp_path / "first", tmp_path / "second"
    for cache in (first, second):
        outcome = run_program(cache, env=environment(cache, TORCHWELD_HELPERS_DIR=str(helpers)))
        assert outcome.ok and not outcome.warnings, outcome.describe()
        assert libraries(cache, "cpp") and not libraries(cache, "guards")
    assert len(libraries(helpers, "guards")) == 1
