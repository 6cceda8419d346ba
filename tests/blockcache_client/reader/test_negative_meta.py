"""Negative metadata caching: a missing path is remembered as missing for the
metadata TTL (Python's import probes many), and a fresh listing of its parent
answers for names it does not hold, without a backend call."""

from __future__ import annotations

import pytest

from tests.support.volumes import volume
from tests.support.waiting import wait_for


def stat_calls(vol) -> list[str]:
    calls: list[str] = []
    vol.backend.observe = lambda what, seconds, exc: calls.append(what)
    return calls


def test_missing_path_is_cached_for_the_ttl(source, key_file):
    with volume(source, key_file, meta_ttl=3600) as vol:
        calls = stat_calls(vol)
        for _ in range(5):
            with pytest.raises(FileNotFoundError) as e:
                vol.stat("nope/mod.py")
            assert "nope/mod.py" in str(e.value)
        assert calls == ["stat"]
        source.write("nope/mod.py", b"x = 1\n")
        with pytest.raises(FileNotFoundError):  # still within the TTL
            vol.stat("nope/mod.py")
        assert vol.stat("nope/mod.py", max_age=0).size == 6
        assert vol.stat("nope/mod.py").size == 6  # and the found entry replaced the miss
        assert calls == ["stat", "stat"]


def test_missing_path_expires_with_the_ttl(source, key_file):
    with volume(source, key_file, meta_ttl=0.2) as vol:
        with pytest.raises(FileNotFoundError):
            vol.stat("late.bin")
        source.write("late.bin", b"abc")
        wait_for(lambda: _found(vol, "late.bin"), what="the negative entry to expire")


def _found(vol, rel) -> bool:
    try:
        return vol.stat(rel).size == 3
    except FileNotFoundError:
        return False


def test_fresh_parent_listing_answers_missing_names(source, key_file):
    source.write("pkg/a.py", b"a")
    with volume(source, key_file, meta_ttl=3600) as vol:
        assert [i.name for i in vol.listdir("pkg")] == ["a.py"]
        calls = stat_calls(vol)
        for name in ("b.py", "b/__init__.py", "c.so"):
            with pytest.raises(FileNotFoundError):
                vol.stat(f"pkg/{name}")
        assert vol.stat("pkg/a.py").size == 1
        # "b/__init__.py" is under a missing dir: only it went to the backend
        assert calls == ["stat"]
        with pytest.raises(FileNotFoundError):  # max_age=0 always asks
            vol.stat("pkg/b.py", max_age=0)
        assert calls == ["stat", "stat"]


def test_second_stat_in_a_directory_lists_it(source, key_file):
    for i in range(20):
        source.write(f"imgs/{i:02d}.jpg", bytes(i))
    with volume(source, key_file, meta_ttl=3600) as vol:
        calls = stat_calls(vol)
        assert [vol.stat(f"imgs/{i:02d}.jpg").size for i in range(20)] == list(range(20))
        with pytest.raises(FileNotFoundError) as e:
            vol.stat("imgs/99.jpg")
        assert "not in the listing" in str(e.value)
        # one stat, then one listing answers the other 19 and the missing name
        assert calls == ["stat", "list"]
        assert vol.stat("imgs/05.jpg", max_age=0).size == 5  # a fresh ask still asks
        assert calls == ["stat", "list", "stat"]


def test_stats_under_a_missing_directory_stop_at_its_listing(source, key_file):
    with volume(source, key_file, meta_ttl=3600) as vol:
        calls = stat_calls(vol)
        for name in ("a.py", "b.py", "c/__init__.py", "d.py", "e.py"):
            with pytest.raises(FileNotFoundError):
                vol.stat(f"gone/{name}")
        # a stat, then the listing that finds the directory missing; "gone/c/..."
        # is answered by the missing parent's entry, the rest by their own
        assert calls[:2] == ["stat", "list"] and len(calls) <= 3, calls


def test_a_file_as_parent_falls_back_to_stats(source, key_file):
    source.write("blob", b"x")
    with volume(source, key_file, meta_ttl=3600) as vol:
        calls = stat_calls(vol)
        for name in ("a", "b", "c"):
            with pytest.raises(OSError):
                vol.stat(f"blob/{name}")
        assert "list" in calls and calls.count("list") == 1, calls
