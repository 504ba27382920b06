"""``python -m sglang_vc.cluster --nodes N [server flags]``: N sglang-vc servers behind
``sglang-router`` (the SGLang project's router, from PyPI) as one service.

Each server is ``python -m sglang_vc.launch_server`` with the given flags on its own port
(``--worker-base-port``, then +1, ...); once all of them serve, the router starts on
``--port`` with cache-aware routing (``--policy``, default ``cache_aware``: a request goes
to the server whose radix tree most likely holds its prefix, unless the load is
unbalanced). Clients talk to the router exactly as to one server: ``/generate``, the
OpenAI API, the DSL.

Every server keeps its own ``sglang_vc`` counters: ``GET ROUTER/workers`` lists the
servers, and each one's ``GET /server_info`` has its ``sglang_vc`` section
(``python -m sglang_vc.cluster --counters ROUTER_URL`` prints them all).

SIGTERM or SIGINT stops the router and every server (each server stops its own
children), then exits; a server that dies stops the whole cluster with an error.

``--remote-prefix`` starts VeriCache's remote prefix caching instead (no router): one
shared store (a local SeaweedFS, or ``--store file``), a *local* server on a fast link to
it and a *remote* server (``VERICACHE_REMOTE``) on a slow one, which loads the KIVI 4-bit
copy of a stored prefix, drafts from it and has the local server verify. Links are
emulated when given (``--local-gbps``, ``--remote-gbps``: paced storage reads). Send
requests to the remote server; a context either server computed is in the store for
both (its full and 4-bit copies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import requests

PROG = "python -m sglang_vc.cluster"
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 8.0  # per process group, before SIGKILL


def log(msg: str) -> None:
    print(f"[sglang_vc.cluster] {msg}", file=sys.stderr, flush=True)


@dataclass
class Member:
    """A child process (a server or the router) in its own process group."""

    name: str
    cmd: list[str]
    url: str
    log_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    def start(self) -> None:
        out = open(self.log_path, "w") if self.log_path else None
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class Stopped(Exception):
    """A signal asked the cluster to stop while it was starting."""


def wait_ready(members: list[Member], path: str, timeout: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    pending = list(members)
    while pending:
        if stop.is_set():
            raise Stopped
        for m in list(pending):
            if not m.alive():
                raise RuntimeError(f"{m.name} exited with {m.proc.returncode} before serving"
                                   + (f" (log: {m.log_path})" if m.log_path else ""))
            try:
                if requests.get(m.url + path, timeout=10).status_code == 200:
                    log(f"{m.name} serves on {m.url}")
                    pending.remove(m)
            except requests.RequestException:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not serving after {timeout:.0f} s: {', '.join(m.name for m in pending)}")
        if pending:
            time.sleep(1.0)


def router_workers(router_url: str, healthy_only: bool = False) -> list[str]:
    """The server URLs the router lists (``GET /workers``), or only those it marks healthy."""
    workers = requests.get(router_url.rstrip("/") + "/workers", timeout=30).json()
    return [w["url"] if isinstance(w, dict) else w for w in workers.get("workers", workers)
            if not (healthy_only and isinstance(w, dict) and not w.get("is_healthy", True))]


def wait_registered(router: Member, urls: list[str], timeout: float, stop: threading.Event) -> None:
    """The router answers ``/health`` before it has registered its workers (an asynchronous
    step after start-up: it answers 503 "no available workers" meanwhile), so the cluster
    serves once ``/workers`` lists every server as healthy."""
    deadline = time.monotonic() + timeout
    while True:
        if stop.is_set():
            raise Stopped
        if not router.alive():
            raise RuntimeError(f"router exited with {router.proc.returncode} before serving")
        try:
            missing = set(urls) - set(router_workers(router.url, healthy_only=True))
        except (requests.RequestException, ValueError):
            missing = set(urls)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router has not registered {', '.join(sorted(missing))} "
                               f"after {timeout:.0f} s")
        time.sleep(0.5)


def stop_all(members: list[Member]) -> None:
    """SIGTERM every group (the router first), wait, SIGKILL what is left."""
    for m in reversed(members):
        m.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for m in reversed(members):
        if m.proc is None:
            continue
        try:
            m.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{m.name} did not stop in {STOP_TIMEOUT_S:.0f} s: killed")
        m.signal(signal.SIGKILL)  # stragglers of the group, if any


def counters(router_url: str) -> dict:
    """Every server's ``sglang_vc`` section, by URL, through the router's worker list."""
    return {url: requests.get(url + "/server_info", timeout=30).json().get("sglang_vc")
            for url in router_workers(router_url)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog="Other flags go to every server (python -m sglang_vc.launch_server).")
    ap.add_argument("--nodes", type=int, default=2, help="servers behind the router (default 2)")
    ap.add_argument("--host", default="127.0.0.1", help="the router's and the servers' host")
    ap.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    ap.add_argument("--worker-base-port", type=int, default=31000, help="the first server's port")
    ap.add_argument("--policy", default="cache_aware",
                    choices=["cache_aware", "round_robin", "random", "power_of_two"])
    ap.add_argument("--log-dir", default=None, help="one log file per server and the router (default: stderr)")
    ap.add_argument("--counters", metavar="ROUTER_URL", default=None,
                    help="print every server's sglang_vc counters through a running router, and exit")
    rp = ap.add_argument_group("Remote prefix caching (VeriCache)")
    rp.add_argument("--remote-prefix", action="store_true",
                    help="start a local server (the verifier, port --worker-base-port) and a remote "
                    "VERICACHE_REMOTE server (the next port) on one shared store, instead of N servers "
                    "behind a router")
    rp.add_argument("--store", choices=["seaweedfs", "file"], default="seaweedfs",
                    help="the shared store: a local SeaweedFS (default; needs requirements/storage.txt) "
                    "or SGLang's file backend in --store-dir")
    rp.add_argument("--store-dir", default=None, help="the store's data directory (default: a new temporary one)")
    rp.add_argument("--local-gbps", type=float, default=None,
                    help="EMULATION: pace the local server's storage reads to G GB/s (default: not paced)")
    rp.add_argument("--remote-gbps", type=float, default=None,
                    help="EMULATION: pace the remote server's storage reads to G GB/s (default: not paced)")
    return ap


def _has(flags: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in flags)


def remote_prefix_servers(args, server_flags: list[str], store_extra: dict, backend: str,
                          log_dir: Optional[Path]) -> list[Member]:
    """The local and remote servers of ``--remote-prefix`` on one store."""
    shared = ["--enable-hierarchical-cache", "--hicache-storage-backend", backend,
              "--hicache-storage-backend-extra-config", json.dumps(store_extra), "--radix-cache-backend", "evicpress"]
    if not _cuda():  # SGLang's default HiCache transfer kernels are CUDA's
        shared += [] if _has(server_flags, "--hicache-io-backend") else ["--hicache-io-backend", "direct"]
        shared += [] if _has(server_flags, "--hicache-mem-layout") else ["--hicache-mem-layout", "layer_first"]
    elif not _has(server_flags, "--mem-fraction-static"):
        # both servers on this machine's GPU: each sizes its pool from what is free
        log("both servers share the GPU: --mem-fraction-static 0.4 each (give it to change)")
        shared += ["--mem-fraction-static", "0.4"]
    ports = (args.worker_base_port, args.worker_base_port + 1)
    urls = [f"http://{args.host}:{p}" for p in ports]
    paced = [[] if g is None else ["--vc-storage-read-gbps", str(g)] for g in (args.local_gbps, args.remote_gbps)]
    roles = [
        ("local server", [*shared, *paced[0]]),
        ("remote server", [*shared, *paced[1], "--speculative-algorithm", "VERICACHE_REMOTE",
                           "--vc-remote-verifier", urls[0], "--evicpress-load-copy", "kivi@4b",
                           "--evicpress-storage-copies", "none"]),
    ]
    return [Member(name, [sys.executable, "-m", "sglang_vc.launch_server", "--host", args.host, "--port", str(port),
                          *server_flags, *extra], url,
                   log_dir / f"{name.replace(' ', '-')}.log" if log_dir else None)
            for (name, extra), port, url in zip(roles, ports, urls)]


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False



def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    args, server_flags = ap.parse_known_args(argv)
    if args.counters:
        print(json.dumps(counters(args.counters), indent=2))
        return 0
    if args.nodes < 1:
        ap.error("--nodes must be at least 1")
    for flag in ("--port", "--host"):
        if _has(server_flags, flag):
            ap.error(f"{flag} is the cluster's own; the servers' ports come from --worker-base-port")
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)

    if args.remote_prefix:
        return run_remote_prefix(args, server_flags, log_dir)
    if any(v is not None for v in (args.store_dir, args.local_gbps, args.remote_gbps)):
        ap.error("--store-dir, --local-gbps and --remote-gbps belong to --remote-prefix")
    servers = []
    for i in range(args.nodes):
        port = args.worker_base_port + i
        servers.append(Member(
            f"server {i}", [sys.executable, "-m", "sglang_vc.launch_server", "--host", args.host,
                            "--port", str(port), *server_flags],
            f"http://{args.host}:{port}", log_dir / f"server-{i}.log" if log_dir else None))
    router = Member("router", [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host,
                               "--port", str(args.port), "--policy", args.policy,
                               "--worker-urls", *[s.url for s in servers]],
                    f"http://{args.host}:{args.port}", log_dir / "router.log" if log_dir else None)
    members = [*servers, router]

    def ready(stop: threading.Event) -> None:
        for s in servers:
            s.start()
        wait_ready(servers, "/health_generate", READY_TIMEOUT_S, stop)
        router.start()
        wait_ready([router], "/health", READY_TIMEOUT_S, stop)
        wait_registered(router, [s.url for s in servers], READY_TIMEOUT_S, stop)
        log(f"{args.nodes} server(s) behind the router on {router.url} ({args.policy})")

    return supervise(members, ready)


def run_remote_prefix(args, server_flags: list[str], log_dir: Optional[Path]) -> int:
    import tempfile

    from sglang_vc import seaweedfs
    from sglang_vc.testing.server import free_ports

    for g in (args.local_gbps, args.remote_gbps):
        if g is not None and not g > 0:
            log("error: --local-gbps and --remote-gbps must be > 0")
            return 2
    for flag in ("--speculative-algorithm", "--radix-cache-backend", "--hicache-storage-backend"):
        if _has(server_flags, flag):
            log(f"error: {flag} is set by --remote-prefix")
            return 2
    temporary = args.store_dir is None
    root = Path(args.store_dir) if args.store_dir else Path(tempfile.mkdtemp(prefix="sglang-vc-store-"))
    store = None
    if args.store == "seaweedfs":
        why = seaweedfs.missing()
        if why:
            log(f"error: {why}; or use --store file")
            return 2
        store = seaweedfs.LocalSeaweedFS(root / "seaweedfs", free_ports(8),
                                         (log_dir or root) / "seaweedfs.log")
        extra, backend = store.extra_config(), "seaweedfs"
    else:
        extra, backend = {"file_storage_path": str(root / "file")}, "file"
    members = remote_prefix_servers(args, server_flags, extra, backend, log_dir)

    def ready(stop: threading.Event) -> None:
        if store is not None:
            try:
                log(f"SeaweedFS store on {store.start()} (data in {store.data_dir})")
            except seaweedfs.SeaweedFSError as exc:
                raise RuntimeError(str(exc)) from None
        for m in members:
            m.start()
        wait_ready(members, "/health_generate", READY_TIMEOUT_S, stop)
        log(f"remote prefix caching: send requests to the remote server {members[1].url}; "
            f"the local server {members[0].url} verifies ({backend} store)")

    try:
        return supervise(members, ready)
    finally:
        if store is not None:
            store.stop()
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def supervise(members: list[Member], ready) -> int:
    """Start the members (``ready``), then wait for a signal or a member's death; stop all."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    code = 0
    try:
        ready(stop)
        while not stop.wait(0.5):
            dead = [m for m in members if m.proc is not None and not m.alive()]
            if dead:
                log(f"{dead[0].name} exited with {dead[0].proc.returncode}: stopping the cluster")
                code = 1
                break
    except Stopped:
        pass
    except (RuntimeError, TimeoutError) as exc:
        log(f"error: {exc}")
        code = 1
    finally:
        log("stopping")
        stop_all(members)
    return code


if __name__ == "__main__":
    sys.exit(main())
