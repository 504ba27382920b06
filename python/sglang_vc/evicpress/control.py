"""The scheduler's EvicPress control channel: a small JSON-over-HTTP server on
``127.0.0.1:<control_port>`` inside the scheduler process.

SGLang's HTTP API lives in the launcher process while the radix cache (and so the
context registry and the tiers) lives in the scheduler process, and SGLang has no
plugin channel between them that returns data. The launcher's ``/evicpress/*`` routes
and the profiler (:mod:`.service`) talk to this server; anything that touches KV runs on
the scheduler thread (``EvicPressManager.submit``), registry reads take the manager lock.

Localhost only, no authentication: it is an internal port (as SGLang's own ZMQ ports).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

import requests

from . import tenant
from .config import DROPPED, CompressionConfig, Placement, Tier

logger = logging.getLogger(__name__)

__all__ = ["ControlServer", "ControlClient", "ControlError"]


class ControlError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _ctx_or_404(mgr, ctx_id: str):
    ctx = mgr.registry.get(ctx_id)
    if ctx is None:
        raise ControlError(404, f"no context {ctx_id!r}")
    return ctx


def _placement(body: dict) -> Placement:
    tier = body.get("tier")
    if tier in (None, "none", "dropped"):
        return DROPPED
    try:
        t = Tier.parse(str(tier))
    except KeyError:
        raise ControlError(400, f"unknown tier {tier!r}") from None
    if t == Tier.DEVICE:
        raise ControlError(400, "the device tier is SGLang's radix tree; place contexts on host or disk")
    try:
        cfg = CompressionConfig.parse(str(body.get("config") or "full"))
    except ValueError as exc:
        raise ControlError(400, str(exc)) from None
    return Placement(cfg, t)


class ControlServer:
    def __init__(self, cache, port: int) -> None:
        self.cache = cache
        self.mgr = cache.evicpress
        self.port = port
        self._server: Optional[ThreadingHTTPServer] = None

    def start(self) -> None:
        handler = _make_handler(self)
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="evicpress-control", daemon=True).start()

    # ------------------------------------------------------------------ routes
    def _consistent(self, fn):
        """Run a read on the scheduler thread, after the stores and promotions the
        backend deferred (so a reply reflects every request already answered); falls
        back to a direct read when the scheduler is busy for long."""
        try:
            return self.mgr.submit(fn, timeout=30)
        except TimeoutError:
            with self.mgr.lock:
                return fn()

    def handle(self, method: str, path: str, query: dict, body: Any) -> Any:
        mgr = self.mgr
        parts = [p for p in path.split("/") if p]
        if parts == ["status"] and method == "GET":
            return self._consistent(mgr.status) if query.get("sync") == ["1"] else mgr.status()
        if parts == ["requests"] and method == "GET":
            rids = query.get("rid")
            return {"requests": mgr.requests.served(rids)}
        if parts == ["contexts"] and method == "GET":
            return self._consistent(lambda: {"contexts": [c.describe() for c in mgr.contexts.values()]})
        if parts == ["contexts"] and method == "POST":
            return self._register(body or {})
        if len(parts) >= 2 and parts[0] == "contexts":
            ctx = _ctx_or_404(mgr, parts[1])
            rest = parts[2:]
            if not rest and method == "GET":
                return self._consistent(lambda: ctx.describe(with_tokens=query.get("tokens") == ["1"]))
            if not rest and method == "DELETE":
                return {"deleted": mgr.submit(lambda: mgr.registry.forget(ctx.ctx_id))}
            if rest == ["placement"] and method in ("POST", "PUT"):
                dst = _placement(body or {})

                def move():
                    try:
                        if ctx.placement.dropped:  # another server left it in the shared store
                            mgr.storage_copies.find_shared(ctx)
                        ok = mgr.set_placement(ctx, dst)
                    except ValueError as exc:
                        raise ControlError(400, str(exc)) from None
                    return {"ok": ok, **ctx.describe()}

                return mgr.submit(move)
            if rest == ["profile"] and method == "POST":
                return {"queued": mgr.profiling.request_profile(ctx.ctx_id)}
            if rest == ["quality"] and method == "POST":
                q = (body or {}).get("quality")
                if not isinstance(q, dict):
                    raise ControlError(400, "body needs {'quality': {config: quality}}")
                try:
                    mgr.profiling.set_profile(ctx.ctx_id, q, reason=(body or {}).get("reason", "api"))
                except ValueError as exc:
                    raise ControlError(400, str(exc)) from None
                return ctx.describe()
            if rest == ["queries"] and method == "POST":
                b = body or {}
                mgr.profiling.add_queries(ctx.ctx_id, b.get("suffixes", []), b.get("texts", []))
                return ctx.describe()
            if rest == ["digest"] and method == "GET":
                return mgr.submit(lambda: self.cache.tree_rows.device_digest(ctx))
        if parts == ["reconfigure"] and method == "POST":
            b = body or {}

            def run():
                try:
                    out = mgr.reconfigure(b.get("policy"), b.get("alpha"), b.get("fixed_config"),
                                          b.get("observe_rate"), b.get("reprofile_threshold"),
                                          b.get("profile_metric"))
                except ValueError as exc:
                    raise ControlError(400, str(exc)) from None
                out["evicted_tokens"] = self.cache.tree_rows.evict_device_all()
                return out

            return mgr.submit(run)
        if parts == ["evict_device"] and method == "POST":
            return {"evicted_tokens": mgr.submit(self.cache.tree_rows.evict_device_all)}
        if parts == ["work"] and method == "GET":
            limit = int(query.get("limit", ["4"])[0])
            return {
                "profiles": mgr.profiling.profile_work(limit),
                "observations": mgr.profiling.take_observations(),
                "idle_seconds": mgr.profiling.idle_for(),
            }
        if parts == ["work", "profile"] and method == "POST":
            b = body or {}
            if b.get("failed"):
                mgr.profiling.release_profile(b["ctx_id"])
                mgr.count(profile_failures=1)
                return {"ok": True}
            return {"ok": mgr.profiling.set_profile(b["ctx_id"], b["quality"], reason=b.get("reason"))}
        if parts == ["work", "observation"] and method == "POST":
            b = body or {}
            return {"reprofile": mgr.profiling.record_observation(b["ctx_id"], b["config"], float(b["quality"]))}
        raise ControlError(404, f"no route {method} /{'/'.join(parts)}")

    def _register(self, body: dict) -> dict:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ControlError(400, "token_ids must be a list of ints")
        suffixes = body.get("query_suffixes") or []
        quality = body.get("quality")
        if quality is not None and not isinstance(quality, dict):
            raise ControlError(400, "quality must be {config: quality} ({} = full KV only)")
        # with a given profile (even {}), registered and profiled at once: the profiler
        # never sees the context unprofiled
        with self.mgr.lock:
            try:
                ctx = self.mgr.registry.register(
                    ids,
                    ctx_id=body.get("id"),
                    namespace=tenant.namespace(body.get("extra_key"), body.get("cache_salt")),
                    queries=suffixes,
                    query_texts=body.get("query_texts") or [],
                )
                if quality is not None:
                    self.mgr.profiling.set_profile(ctx.ctx_id, quality, reason="api")
            except ValueError as exc:
                raise ControlError(400, str(exc)) from None
            return ctx.describe()


def _make_handler(server: ControlServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet
            logger.debug("control: " + fmt, *args)

        def _do(self, method: str):
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = None
            try:
                if length:
                    body = json.loads(self.rfile.read(length))
                out = server.handle(method, url.path, parse_qs(url.query), body)
                status, payload = 200, out
            except ControlError as exc:
                status, payload = exc.status, {"error": str(exc)}
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
                status, payload = 400, {"error": f"bad request: {exc}"}
            except Exception as exc:  # noqa: BLE001
                logger.exception("EvicPress control %s %s failed", method, self.path)
                status, payload = 500, {"error": str(exc)}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._do("GET")

        def do_POST(self):
            self._do("POST")

        def do_PUT(self):
            self._do("PUT")

        def do_DELETE(self):
            self._do("DELETE")

    return Handler


class ControlClient:
    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.timeout = timeout
        self._session = requests.Session()

    def call(self, method: str, path: str, body: Any = None, params: Optional[dict] = None) -> Any:
        r = self._session.request(method, self.base + path, json=body, params=params, timeout=self.timeout)
        try:
            payload = r.json()
        except ValueError:
            payload = {"error": r.text}
        if r.status_code != 200:
            raise ControlError(r.status_code, payload.get("error", r.text) if isinstance(payload, dict) else r.text)
        return payload
