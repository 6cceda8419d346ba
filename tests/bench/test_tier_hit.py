"""bench.tier_hit on two blocks: both figures printed, the target judged,
and bad arguments refused by name."""

import pytest

from bench import tier_hit


def test_it_prints_the_hit_with_and_without_the_hand_off(capsys, tmp_path):
    tier_hit.main(["--blocks", "2", "--rounds", "2", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "tier hit, handed to the daemon:" in out and "the daemon" in out, out
    assert "tier hit alone:" in out, out
    (target,) = [line for line in out.splitlines() if line.startswith("target:")]
    assert target.endswith(("MET", "MISS")), out


def test_fewer_than_two_rounds_is_refused(capsys):
    with pytest.raises(SystemExit):
        tier_hit.main(["--rounds", "1"])
    assert "--rounds" in capsys.readouterr().err
