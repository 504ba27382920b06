"""Live counters: per-process snapshots, merging across schedulers, Prometheus export."""

from __future__ import annotations

import subprocess
import sys


def test_snapshot_and_merge():
    from sglang_vc import stats

    stats.add("unit_test", rounds=2, tokens=5.5)
    stats.add("unit_test", rounds=1)
    snap = stats.snapshot()["unit_test"]
    assert snap == {"rounds": 3.0, "tokens": 5.5}
    merged = stats.merge([{"unit_test": snap}, {"unit_test": {"rounds": 4, "note": "x"}}, {}])
    assert merged == {"unit_test": {"rounds": 7.0, "tokens": 5.5}}


def test_counters_reach_prometheus_multiprocess_registry(tmp_path):
    """What SGLang's /metrics does: a MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR
    sees counters incremented in another process."""
    writer = "from sglang_vc import stats; stats.add('unit_test', verify_rounds=3); stats.add('unit_test', verify_rounds=2)"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": ""}
    subprocess.run([sys.executable, "-c", writer], check=True, env=env, timeout=120)
    reader = (
        "from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
        "r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)\n"
        "print(generate_latest(r).decode())"
    )
    out = subprocess.run([sys.executable, "-c", reader], check=True, env=env, capture_output=True,
                         text=True, timeout=120).stdout
    assert "sglang_vc:unit_test_verify_rounds_total 5.0" in out
