"""``bench.cpu_draft_step``: the report's shape and its ratio."""

from __future__ import annotations

import json

import pytest

from sglang_vc.bench import cpu_draft_step


def test_report_times_both_steps_on_the_same_lengths(tmp_path):
    out = tmp_path / "step.json"
    cpu_draft_step.main(["--json", str(out), "--lengths", "256,512", "--repeats", "1"])
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [256, 512]
    for row in report["rows"]:
        assert row["full_ms"] > 0 and row["specache_ms"] > 0
        assert row["specache_x_full"] == pytest.approx(row["specache_ms"] / row["full_ms"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_bad_arguments_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        cpu_draft_step.main(["--json", str(tmp_path / "x.json"), "--lengths", "4k"])
    assert exc.value.code == 2
