"""Two sglang-vc servers behind sglang-router (``python -m sglang_vc.cluster``, what
``make serve-cluster N=2`` runs) serve as one: a mixed workload through the router is
answered by both servers, requests sharing a long prefix go to the server that cached it,
the answers equal a single server's greedy answers, and every server's counters are
readable through the router."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from sglang_vc.cluster import counters
from sglang_vc.testing.server import free_port

from conftest import real_text_passages

NEW = 8


def _consecutive_free_ports(n: int) -> int:
    for _ in range(50):
        base = free_port()
        ok = True
        for p in range(base + 1, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster")
    port, base = free_port(), _consecutive_free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_vc.cluster", "--nodes", "2", "--port", str(port),
         "--worker-base-port", str(base), "--log-dir", str(logs),
         "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "8192", "--enable-metrics"],
        stdout=open(logs / "cluster.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, (logs / "cluster.log").read_text()
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200 and \
                    "behind the router" in (logs / "cluster.log").read_text():
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    else:
        _stop(proc)
        pytest.fail("cluster not serving:\n" + (logs / "cluster.log").read_text())
    yield url, [f"http://127.0.0.1:{base + i}" for i in range(2)], proc, logs
    _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher, which stops the router and every server (each in a process
    group of its own: a SIGKILL of the launcher's group would leave them running)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _ask(url: str, text: str) -> dict:
    r = requests.post(url + "/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _requests_served(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


@pytest.mark.slow  # 15-min default budget: routing is served only here (launch logic in process below)
def test_router_spreads_routes_by_prefix_and_answers_as_one_server(cluster, tokenizer):
    url, workers, _, _ = cluster
    passages = real_text_passages(7, words=220)
    groups = [passages[i] + "\n" for i in range(3)]  # three long shared prefixes
    prompts = [g + f"Question {j}: what is this text about?" for g in groups for j in range(3)]
    prompts += [p[:300] for p in passages[3:]]  # unrelated short prompts
    before = sum(_requests_served(w) for w in workers)

    routed = [_ask(url, p) for p in prompts]  # one at a time: the same batches as one server

    served = [_requests_served(w) for w in workers]
    assert all(n > 0 for n in served), f"a server answered nothing: {served}"
    assert sum(served) - before == len(prompts)
    for g, group in enumerate(groups):
        prefix = len(tokenizer(group)["input_ids"])
        for j in (1, 2):  # the later requests of a group reuse the first one's prefix on its server
            cached = routed[3 * g + j]["meta_info"]["cached_tokens"]
            assert cached >= prefix - 2, f"group {g} request {j}: {cached} of {prefix} prefix tokens cached"
    single = [_ask(workers[0], p) for p in prompts]
    assert [r["output_ids"] for r in routed] == [r["output_ids"] for r in single]


@pytest.mark.slow  # the cluster fixture (see above)
def test_every_servers_counters_through_the_router(cluster):
    url, workers, _, _ = cluster
    found = counters(url)
    assert sorted(found) == sorted(workers)
    assert all("counters" in section and "kv_pool" in section["counters"] for section in found.values())


@pytest.mark.slow  # the cluster fixture; one server's SIGTERM stop: test_lifecycle
def test_sigterm_stops_the_cluster(cluster):
    url, _, proc, logs = cluster
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 8, "cluster, router, and launcher, scheduler, detokenizer per server expected"
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)

    def alive():
        return [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    while alive() and time.monotonic() - t < 10.0:
        time.sleep(0.2)
    assert not alive(), f"left behind: {alive()}\n" + (logs / "cluster.log").read_text()[-3000:]
    assert time.monotonic() - t < 10.0 and proc.returncode == 0


@pytest.mark.slow
def test_remote_prefix_preset_serves_a_stored_prefix_exactly_from_the_remote_server(model_dir, tmp_path, tokenizer):
    """``--remote-prefix``: a local SeaweedFS, a local and a remote server on it. A context
    the local server computed reaches the remote server as its 4-bit copy; the remote
    answers on it as the local server does, its tokens verified by the local server."""
    from sglang_vc.seaweedfs import missing

    if missing():
        pytest.skip(missing())
    base = _consecutive_free_ports(2)
    local, remote = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_vc.cluster", "--remote-prefix", "--store-dir", str(tmp_path / "store"),
         "--worker-base-port", str(base), "--log-dir", str(tmp_path), "--remote-gbps", "0.05",
         "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "4096",
         "--evicpress-no-profiler", "--evicpress-auto-context-tokens", "0", "--speculative-num-draft-tokens", "4"],
        stdout=open(tmp_path / "cluster.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 420
        while "remote prefix caching: send requests" not in (tmp_path / "cluster.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "cluster.log").read_text()[-3000:]
            time.sleep(1)
        ids = tokenizer(real_text_passages(2, words=400)[0])["input_ids"][:400]
        prompt = ids + tokenizer("\n\nQuestion: What is this text about?\nAnswer:", add_special_tokens=False)["input_ids"]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        for url in (local, remote):
            r = requests.post(url + "/evicpress/contexts", json={"id": "doc", "token_ids": ids}, timeout=60)
            assert r.status_code == 200, r.text
        want = requests.post(local + "/generate", json=body, timeout=300).json()  # computes it: copies to the store
        got = requests.post(remote + "/generate", json=body, timeout=300).json()
        assert got["output_ids"] == want["output_ids"], (got, want)
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        c = requests.get(remote + "/server_info", timeout=30).json()["sglang_vc"]["counters"]
        assert c["evicpress"]["shared_found"] == 1 and c["vericache_remote"]["first_tokens_verified"] == 1, c
        assert c["storage_link"]["read_bytes"] > 0, c  # the remote's paced link carried the copy
        assert "seaweedfs" in (tmp_path / "cluster.log").read_text().lower()
    finally:
        _stop(proc)
    assert proc.returncode == 0, (tmp_path / "cluster.log").read_text()[-3000:]


def test_the_cluster_serves_only_once_the_router_lists_every_server_healthy():
    """The router answers /health before its asynchronous worker registration (then a
    request gets 503 "no available workers"): the launcher waits for /workers instead."""
    import http.server
    import json
    import threading

    from sglang_vc.cluster import Member, wait_registered

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    answers = [[], [{"url": urls[0], "is_healthy": True}],
               [{"url": urls[0], "is_healthy": True}, {"url": urls[1], "is_healthy": False}]]
    final = [{"url": u, "is_healthy": True} for u in urls]
    seen = []

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"workers": answers[len(seen)] if len(seen) < len(answers) else final}).encode()
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    router = Member("router", [sys.executable, "-c", "import time; time.sleep(60)"],
                    f"http://127.0.0.1:{httpd.server_port}")
    router.start()
    try:
        wait_registered(router, urls, 30.0, threading.Event())
        assert seen == ["/workers"] * 4  # not before both are listed and healthy
        seen.clear()
        answers[:] = [[]] * 1000
        with pytest.raises(TimeoutError, match="has not registered"):
            wait_registered(router, urls, 1.0, threading.Event())
    finally:
        router.signal(signal.SIGKILL)
        httpd.shutdown()
