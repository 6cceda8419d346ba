"""bench.warm_parts on one block: every part printed with the budget, the
hand-offs' share and the ceiling against R, and bad arguments refused by name."""

import pytest

from bench import warm_parts


def test_it_prints_each_part_and_the_budget(capsys, tmp_path):
    warm_parts.main(["--mib", "4", "--rounds", "1", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    for part in ("aes 1 thread", "aes per thread", "pread", "copy", "read alone",
                 "mmap, MAP_POPULATE", "mmap, MADV_WILLNEED", "mmap, each unit mlocked",
                 "read split over", "budget at 0.8x R", "hand-offs of the split read",
                 "split reads without Volume", "no hand-off", "processes (no GIL",
                 "load average"):
        assert part in out, out
    rows = dict(line.rsplit(None, 1) for line in out.splitlines()[1:10])
    assert all(float(us) > 0 for us in rows.values()), out
    assert list(tmp_path.iterdir()) == []  # the block files are removed


def test_less_than_a_block_is_refused(capsys):
    with pytest.raises(SystemExit):
        warm_parts.main(["--mib", "2"])
    assert "--mib" in capsys.readouterr().err
