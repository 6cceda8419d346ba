"""The mount process's garbage-collector settings (gctune.tune_gc)."""

from __future__ import annotations

import gc

from fsclient.gctune import GC_YOUNG_THRESHOLD, tune_gc


def test_tune_gc_freezes_startup_objects_and_collects_young_ones_less_often():
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0  # walked by no collection from now on
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
