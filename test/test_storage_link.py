"""The emulated storage link (``storage_link.py``): reads paced by a token bucket, the flag
carried in the storage backend's extra config, bad values refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_vc import storage_link
from sglang_vc.config import ConfigError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_link_carries_bytes_at_its_rate_and_queues_back_to_back_reads():
    clock = Clock()
    link = storage_link.Link(1e9, clock=clock, sleep=clock.sleep)
    assert link.carry(500_000_000) == pytest.approx(0.5)
    assert clock.now == pytest.approx(0.5)
    clock.now += 2.0  # idle: the next read starts fresh
    assert link.carry(100_000_000) == pytest.approx(0.1)
    assert link.carry(0) == 0.0


def test_a_small_read_is_not_queued_behind_a_whole_large_one():
    """Reads go over the link in slices: a one-slice read that starts while a three-slice
    read is under way (here: during its first slice's wait) waits one slice, where a
    link that reserved the whole large read at once would make it wait three."""
    clock = Clock()
    s = storage_link.SLICE_BYTES / 1e9
    small = []

    def sleep(seconds):
        clock.now += seconds
        if not small:  # the small read arrives during the large one's first slice
            small.append(None)
            small[0] = link.carry(storage_link.SLICE_BYTES)

    link = storage_link.Link(1e9, clock=clock, sleep=sleep)
    large = link.carry(3 * storage_link.SLICE_BYTES)
    assert small[0] == pytest.approx(s)  # its own slice only
    assert large == pytest.approx(3 * s) and clock.now == pytest.approx(4 * s)  # 4 slices carried in all


def test_a_background_read_yields_to_foreground_reads():
    """While a foreground read is on the link, a background read's slices wait; once it
    is done they go. Pinned by the recorded schedule: the foreground read counts as
    carrying for the background read's first two tries."""
    clock = Clock()
    s = storage_link.SLICE_BYTES / 1e9
    tries = []

    def sleep(seconds):
        clock.now += seconds
        tries.append(link.foreground)
        if len(tries) == 2:
            link.foreground -= 1  # the foreground read finishes

    link = storage_link.Link(1e9, clock=clock, sleep=sleep)
    link.foreground = 1  # a foreground read is carrying
    with storage_link.background_reads():
        waited = link.carry(storage_link.SLICE_BYTES)
    assert tries == [1, 1, 0]  # two yields, then its slice
    assert waited == pytest.approx(3 * s) and link.foreground == 0
    assert link.carry(storage_link.SLICE_BYTES) == pytest.approx(s)  # foreground, outside the block


class FakeBackend:
    def __init__(self):
        self.extra = "backend-specific"

    def register_mem_pool_host(self, pool):
        self.pool = pool

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return [k != "missing" for k in keys]

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        return [True] * len(keys)

    def get(self, key, target_location=None, target_sizes=None):
        return torch.zeros(256, dtype=torch.float16)


def test_paced_reads_count_only_the_pages_that_arrived(monkeypatch):
    waits = []
    paced = storage_link.pace_created_backend(FakeBackend(), SimpleNamespace(extra_config={"vc_read_gbps": 2.0}))
    assert isinstance(paced, storage_link.PacedReads) and paced.link.bytes_per_s == 2e9
    monkeypatch.setattr(paced.link, "carry", lambda n: waits.append(n) or 0.0)
    paced.register_mem_pool_host(SimpleNamespace(size_per_token=1000))
    # 2 pages of 4 tokens, one of them missing: 4 tokens of 1000 bytes arrived
    assert paced.batch_get_v1(["a", "missing"], torch.arange(8)) == [True, False]
    assert paced.get("k").numel() == 256
    assert paced.batch_set_v1(["a"], torch.arange(4)) == [True]  # writes are not paced
    assert waits == [4000, 512]
    assert paced.extra == "backend-specific"  # the backend's own attributes reach through
    plain = FakeBackend()
    assert storage_link.pace_created_backend(plain, SimpleNamespace(extra_config=None)) is plain


def test_flag_goes_into_the_extra_config_and_needs_a_storage_tier():
    argv = ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", '{"a": 1}']
    out = storage_link.storage_argv({"read_gbps": 0.5}, argv)
    extra = json.loads(out[out.index("--hicache-storage-backend-extra-config") + 1])
    assert extra == {"a": 1, "vc_read_gbps": 0.5} and out.count("--hicache-storage-backend-extra-config") == 1
    assert storage_link.storage_argv(None, argv) == argv
    with pytest.raises(ConfigError, match="storage tier"):
        storage_link.storage_argv({"read_gbps": 0.5}, ["--enable-hierarchical-cache"])


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_bad_rates_are_usage_errors(bad, capsys):
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                    "--vc-storage-read-gbps", bad])
    assert e.value.code == 2 and "--vc-storage-read-gbps" in capsys.readouterr().err


def test_launcher_carries_the_rate_to_sglang():
    from sglang_vc.launch_server import parse_args

    vc, sa = parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                         "--vc-storage-read-gbps", "0.25"])
    assert json.loads(sa.hicache_storage_backend_extra_config)["vc_read_gbps"] == 0.25
    assert vc.enabled_mechanisms()["storage_link"] == {"read_gbps": 0.25, "emulated": True}


@pytest.mark.slow  # a server with HiCache's file storage tier
def test_a_paced_server_reads_a_storage_hit_at_the_link_rate(tmp_path):
    """A prompt stored, the device and host flushed, then asked again: its KV comes from
    storage through the paced link (counted), and the request cannot finish before a link
    of that speed would have delivered those bytes."""
    import time

    import requests

    from sglang_vc.testing.server import ServerProcess

    from conftest import real_text_passages

    storage = tmp_path / "storage"
    storage.mkdir()
    gbps = 0.01
    proc = ServerProcess([
        "--dtype", "float32", "--enable-hierarchical-cache", "--hicache-size", "1",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--hicache-storage-backend", "file", "--file-storage-path", str(storage),
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 32}),
        "--vc-storage-read-gbps", str(gbps),
    ], log_path=tmp_path / "server.log")
    try:
        text = " ".join(real_text_passages(6, words=100))
        body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        first = requests.post(proc.url + "/generate", json=body).json()
        prompt = first["meta_info"]["prompt_tokens"]
        deadline = time.monotonic() + 60
        while sum(1 for _ in storage.iterdir()) < prompt // 64 and time.monotonic() < deadline:
            time.sleep(0.2)  # HiCache writes to storage asynchronously
        time.sleep(1.0)
        assert requests.post(proc.url + "/flush_cache").status_code == 200
        info = lambda: requests.get(proc.url + "/server_info").json()["sglang_vc"]  # noqa: E731
        assert info()["mechanisms"]["storage_link"] == {"read_gbps": gbps, "emulated": True}
        t0 = time.monotonic()
        again = requests.post(proc.url + "/generate", json=body).json()
        elapsed = time.monotonic() - t0
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= prompt // 2, again["meta_info"]
        link = info()["counters"]["storage_link"]
        assert link["read_bytes"] > 0, proc.log_tail()
        assert link["waited_s"] <= link["read_bytes"] / (gbps * 1e9) + 1e-6
        assert elapsed >= link["read_bytes"] / (gbps * 1e9) * 0.99
    finally:
        proc.stop()
