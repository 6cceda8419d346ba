"""bench.policy_cost on a small index: every op under both policies, the
ratio judged, and the put timing the write's completion (the block indexed)."""

from bench import policy_cost


def test_it_prints_each_op_with_its_ratio_and_verdict(capsys):
    policy_cost.main(["--entries", "2000", "--rounds", "2", "--chunk", "200"])
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines()[2:]}
    for op in ("lookup", "touch", "touch x64", "put (room)", "put (full)"):
        assert op in rows, out
        assert rows[op].rstrip().endswith(("met", "NOT MET")), out
        assert "x " in rows[op], out  # the ratio, e.g. "1.02x met"
    assert "index B/entry" in out and "target <= 250" in out


def test_a_put_is_timed_through_its_write(tmp_path):
    """A put's dir job counts as done at once: the block is indexed, with
    the policy's count, before `put` returns."""
    engine = policy_cost.engine(str(tmp_path), 100, "tinylfu", full=False)
    key = policy_cost.block_key(100)
    assert engine.put(key, b"\0" * policy_cost.BLOCK) == (True, "queued")
    assert key in engine.index and not engine.fill.pending
    assert engine.index.count_of(key) == 1
