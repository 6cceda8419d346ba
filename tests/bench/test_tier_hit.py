"""bench.tier_hit on two blocks: both figures printed, the target judged,
and bad arguments refused by name."""

import tempfile

import pytest

from bench import tier_hit


def test_it_prints_the_hit_with_and_without_the_hand_off(capsys):
    # a short workdir: the daemons' socket paths under it must fit AF_UNIX's
    # 108 bytes, which a pytest-xdist worker's tmp_path can take up
    with tempfile.TemporaryDirectory(prefix="tier-hit-") as workdir:
        tier_hit.main(["--blocks", "2", "--rounds", "2", "--workdir", workdir])
    out = capsys.readouterr().out
    assert "tier hit, handed to the daemon:" in out and "the daemon" in out, out
    assert "tier hit alone:" in out, out
    (target,) = [line for line in out.splitlines() if line.startswith("target:")]
    assert target.endswith(("MET", "MISS")), out


def test_fewer_than_two_rounds_is_refused(capsys):
    with pytest.raises(SystemExit):
        tier_hit.main(["--rounds", "1"])
    assert "--rounds" in capsys.readouterr().err
