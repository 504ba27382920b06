"""EvicPress in the launcher process: flag checks, the ``/evicpress/*`` HTTP routes and
the background profiler.

Routes (JSON; added to SGLang's FastAPI app by ``python -m sglang_vc.launch_server``):

* ``POST /evicpress/contexts`` -- register a context: ``{"id"?, "text" | "token_ids",
  "queries"?: [str], "query_template"?: str, "query_suffix_ids"?: [[int]],
  "extra_key"?: str, "cache_salt"?: str, "quality"?: {config: q}, "prefill"?: bool}``
  (``cache_salt``: the tenant whose requests alone reuse it, :mod:`.tenant`). The query set is what
  the profiler answers under each candidate config; ``query_template`` (default
  ``"\\n\\nQuestion: {query}\\nAnswer:"``) turns a query into the prompt suffix after the
  context. ``prefill`` computes (and so stores) the context right away.
* ``GET /evicpress/contexts``, ``GET|DELETE /evicpress/contexts/{id}`` -- placement
  (tier, config, stored bytes), device form, frequency, quality profile, hits per tier.
* ``POST /evicpress/contexts/{id}/placement`` ``{"tier": "host"|"disk"|"dropped",
  "config"?: "kivi@4b"}`` -- move a context by hand (compression is one-way).
* ``POST /evicpress/contexts/{id}/profile`` -- (re-)profile it when idle;
  ``POST /evicpress/contexts/{id}/quality`` ``{"quality": {...}}`` -- give its profile.
* ``POST /evicpress/contexts/{id}/observations`` ``{"config", "quality"}`` -- report the
  quality of an answer served under ``config`` (e.g. a task metric from the
  application); it feeds the same re-profiling trigger as the profiler's own checks.
* ``GET /evicpress/contexts/{id}/digest`` -- xxh3 of its device and stored KV (tests).
* ``GET /evicpress/requests[?rid=...]`` -- the latest user requests (8,192) that matched
  a context: its id, the tier its rows came from (``device``/``host``/``disk``/``miss``)
  and the form served, by rid (under concurrent requests the counters cannot say which).
* ``GET /evicpress/status`` -- tiers, delay-model inputs, counters;
  ``POST /evicpress/evict_device`` -- evict every unlocked node from the device tree;
  ``POST /evicpress/reconfigure`` ``{"policy"?, "alpha"?, "fixed_config"?,
  "observe_rate"?, "reprofile_threshold"?}`` -- empty the tiers and switch policy (and
  the drift check's sampling and threshold; profiles are kept): several systems in one
  runtime.

Counters also appear in the ``sglang_vc`` section of ``/server_info`` and, with
``--enable-metrics``, on ``/metrics`` (``sglang_vc:evicpress_*``).

The profiler (:class:`ProfilerService`, a thread here) waits until the server has been
idle for ``--evicpress-idle-seconds``, then (paper section 4.3):

* profiles contexts: full-KV reference answers (namespace ``evicpress:ref``) and answers
  under each candidate config (``evicpress:cfg:<config>``, the scheduler loads the
  compressed version: dequantized KV, or for token dropping the kept rows, attended as
  a compressed prefix exactly as a user hit is served), concurrently so SGLang batches
  them; quality = mean MiniLM-L6-v2
  cosine of each answer with its reference, made monotone per method
  (``profiler.monotone_profile``). Contexts without queries get
  ``--evicpress-generate-queries`` questions built from their own text (:mod:`.probes`)
  or, with ``--evicpress-profile-source model``, written by the served model;
* checks sampled answers served from compressed KV against the full-KV answer and
  reports the quality; a drop below the profile by ``--evicpress-reprofile-threshold``
  makes the scheduler queue a re-profile on the newest online queries.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Optional

import requests

from .config import CompressionConfig
from .control import ControlClient, ControlError
from .flags import settings_of
from .context import ref_namespace, variant_namespace
from .probes import ProbeSource, context_probes
from .profiler import ProfileMetric, likelihood_quality, monotone_profile

logger = logging.getLogger(__name__)

PROG = "python -m sglang_vc.launch_server"
DEFAULT_TEMPLATE = "\n\nQuestion: {query}\nAnswer:"
QUESTION_PROMPT = "\n\nWrite one short question about the text above.\nQuestion:"


def _die(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _explicit(ep: dict) -> list[str]:
    """EvicPress flags given with a non-default value."""
    import argparse

    from .flags import add_cli_args

    p = argparse.ArgumentParser(add_help=False)
    add_cli_args(p)
    defaults = vars(p.parse_args([]))
    return [
        "--" + k.replace("_", "-")
        for k, v in defaults.items()
        if k.startswith("evicpress_") and ep.get(k[len("evicpress_"):]) != v
        and k not in ("evicpress_methods", "evicpress_bits", "evicpress_ratios", "evicpress_fixed_config",
                      "evicpress_storage_copies")
    ]


def check_server_args(vc_config, server_args) -> bool:
    """Exit 2 (argparse style) on EvicPress flags that cannot work together with
    SGLang's; True when EvicPress is in use."""
    ep = settings_of(vc_config)
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend != "evicpress":
        given = _explicit(ep) if ep else []
        if given:
            _die(f"{given[0]} needs --radix-cache-backend evicpress")
        return False
    if not ep.get("enabled"):  # set by the launcher for --radix-cache-backend evicpress
        _die("--radix-cache-backend evicpress: start it with python -m sglang_vc.launch_server")
    if not getattr(server_args, "hicache_storage_backend", None):
        _die("--radix-cache-backend evicpress needs a storage tier: --evicpress-disk-dir DIR "
             "(our checksummed file backend) or --hicache-storage-backend NAME (e.g. file, seaweedfs)")
    if not getattr(server_args, "enable_hierarchical_cache", False):
        _die("--radix-cache-backend evicpress needs --enable-hierarchical-cache "
             "(its host tier is the HiCache host pool)")
    if getattr(server_args, "disable_radix_cache", False):
        _die("--radix-cache-backend evicpress cannot run with --disable-radix-cache")
    if getattr(server_args, "hicache_write_policy", None) == "write_back":
        # write-back backs nodes up inside SGLang's eviction walk, where the rows
        # EvicPress stores itself cannot be left out (radix.py)
        _die("--radix-cache-backend evicpress needs --hicache-write-policy write_through "
             "or write_through_selective, not write_back")
    if getattr(server_args, "hicache_host_memory_mode", "cache") == "buffer_only":
        # a buffer-only host pool keeps nothing: EvicPress's host tier is that pool
        _die("--radix-cache-backend evicpress needs --hicache-host-memory-mode cache, not buffer_only "
             "(its host tier is the HiCache host pool)")
    layout = getattr(server_args, "hicache_mem_layout", "layer_first")
    if layout not in ("layer_first", "page_first"):
        _die(f"--radix-cache-backend evicpress needs --hicache-mem-layout layer_first or page_first, got {layout}")
    if getattr(server_args, "tp_size", 1) != 1 or getattr(server_args, "dp_size", 1) != 1:
        _die("--radix-cache-backend evicpress supports --tp-size 1 and --dp-size 1 only")
    return True


def install(vc_config, server_args) -> None:
    """Check the flags; with EvicPress in use, add the routes and start the profiler."""
    if not check_server_args(vc_config, server_args):
        return
    from fastapi import Body, HTTPException, Query
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel, auth_level

    ep = settings_of(vc_config)
    client = ControlClient(int(ep["control_port"]))
    tok = _Tokenizer(server_args)
    app = http_server.app
    host = server_args.host if server_args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    base_url = f"http://{host}:{server_args.port}"

    def call(method: str, path: str, body: Any = None, params: Optional[dict] = None):
        try:
            return client.call(method, path, body, params)
        except ControlError as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        except requests.RequestException as exc:
            raise HTTPException(status_code=503, detail=f"EvicPress is not ready: {exc}") from None

    def register(body: dict = Body(...)):
        body = dict(body)
        payload = _context_payload(body, tok, context_limit(server_args))
        info = call("POST", "/contexts", payload)
        if body.get("prefill"):
            suffixes = payload["query_suffixes"]
            _generate(base_url, payload["token_ids"] + (suffixes[0] if suffixes else []),
                      max_new_tokens=1, extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
            info = call("GET", f"/contexts/{info['id']}")
        return info

    def list_contexts():
        return call("GET", "/contexts")

    def status():
        return call("GET", "/status", params={"sync": 1})

    def served(rid: Optional[list[str]] = Query(None)):
        return call("GET", "/requests", params=None if not rid else {"rid": rid})

    def evict_device():
        return call("POST", "/evict_device")

    def reconfigure(body: dict = Body(...)):
        return call("POST", "/reconfigure", body)

    def get_ctx(ctx_id: str, tokens: int = 0):
        if tokens:
            _admin_key_configured(server_args, "a context's token ids")
        return call("GET", f"/contexts/{ctx_id}", params={"tokens": tokens})

    def del_ctx(ctx_id: str):
        return call("DELETE", f"/contexts/{ctx_id}")

    def place(ctx_id: str, body: dict = Body(...)):
        return call("POST", f"/contexts/{ctx_id}/placement", body)

    def profile(ctx_id: str):
        return call("POST", f"/contexts/{ctx_id}/profile")

    def quality(ctx_id: str, body: dict = Body(...)):
        return call("POST", f"/contexts/{ctx_id}/quality", body)

    def digest(ctx_id: str):
        _admin_key_configured(server_args, "a context's KV digests")
        return call("GET", f"/contexts/{ctx_id}/digest")

    def observe(ctx_id: str, body: dict = Body(...)):
        if not isinstance(body.get("quality"), (int, float)) or not isinstance(body.get("config"), str):
            raise HTTPException(400, "body needs {'config': str, 'quality': number}")
        return call("POST", "/work/observation", {"ctx_id": ctx_id, **body})

    # SGLang's level for its own cache routes (/flush_cache): open without keys, behind
    # --admin-api-key (else --api-key) where one is set. Routes that return what requests
    # sent (token ids, KV digests) also need --admin-api-key configured (checked above), as
    # SGLang's HiCache storage-backend route does.
    routes = [("/evicpress/contexts", register, "POST"), ("/evicpress/contexts", list_contexts, "GET"),
              ("/evicpress/status", status, "GET"), ("/evicpress/requests", served, "GET"), ("/evicpress/evict_device", evict_device, "POST"),
              ("/evicpress/reconfigure", reconfigure, "POST"), ("/evicpress/contexts/{ctx_id}", get_ctx, "GET"),
              ("/evicpress/contexts/{ctx_id}", del_ctx, "DELETE"),
              ("/evicpress/contexts/{ctx_id}/placement", place, ["POST", "PUT"]),
              ("/evicpress/contexts/{ctx_id}/profile", profile, "POST"),
              ("/evicpress/contexts/{ctx_id}/quality", quality, "POST"),
              ("/evicpress/contexts/{ctx_id}/digest", digest, "GET"),
              ("/evicpress/contexts/{ctx_id}/observations", observe, "POST")]
    for path, endpoint, methods in routes:
        app.add_api_route(path, auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint),
                          methods=[methods] if isinstance(methods, str) else methods)

    if not ep.get("no_profiler"):
        ProfilerService(client, base_url, tok, float(ep["idle_seconds"])).start()


def _context_payload(body: dict, tok, limit: int) -> dict:
    """A registration's body checked (HTTP 400 with the reason) and made the control
    process's payload: token ids (from ``text`` if given), the queries' suffixes."""
    from fastapi import HTTPException

    if "token_ids" not in body:
        if not isinstance(body.get("text"), str):
            raise HTTPException(400, "give 'text' or 'token_ids'")
        body["token_ids"] = tok.encode(body["text"])
    ids = body["token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HTTPException(400, "token_ids must be a non-empty list of token ids")
    if len(ids) > limit:
        raise HTTPException(400, f"a context has at most {limit} tokens (the model's context length), "
                            f"got {len(ids)}")
    template = body.get("query_template") or DEFAULT_TEMPLATE
    if "{query}" not in template:
        raise HTTPException(400, "query_template must contain {query}")
    queries = body.get("queries") or []
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise HTTPException(400, "queries must be a list of strings")
    suffixes = list(body.get("query_suffix_ids") or [])
    suffixes += [tok.encode(template.format(query=q), special=False) for q in queries]
    return {
        "id": body.get("id"),
        "token_ids": ids,
        "extra_key": body.get("extra_key"),
        "cache_salt": body.get("cache_salt"),  # the tenant: only its requests reuse the context
        "query_suffixes": suffixes,
        "query_texts": queries,
        "quality": body.get("quality"),
    }


def _admin_key_configured(server_args, what: str) -> None:
    """403 unless the server was started with ``--admin-api-key`` (the route's auth level
    then makes the client present it): ``what`` is other users' data."""
    from fastapi import HTTPException

    if not getattr(server_args, "admin_api_key", None):
        raise HTTPException(403, f"{what} are shown only on a server started with --admin-api-key (and to a client "
                            "presenting it as 'Authorization: Bearer KEY')")


def context_limit(server_args) -> int:
    """The most tokens a context may have: ``--context-length``, else the model's own."""
    import json
    from pathlib import Path

    if getattr(server_args, "context_length", None):
        return int(server_args.context_length)
    try:
        config = json.loads((Path(server_args.model_path) / "config.json").read_text())
        return int(config.get("max_position_embeddings") or 1 << 20)
    except (OSError, ValueError):
        return 1 << 20  # a model folder without a readable config: SGLang's own checks apply


class _Tokenizer:
    """The served model's tokenizer, loaded on first use (as SGLang tokenizes text)."""

    def __init__(self, server_args) -> None:
        self.path = server_args.tokenizer_path or server_args.model_path
        self.trust = getattr(server_args, "trust_remote_code", False)
        self._tok = None
        self._lock = threading.Lock()

    @property
    def tok(self):
        with self._lock:
            if self._tok is None:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust)
            return self._tok

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _generate(base_url: str, input_ids, *, max_new_tokens: int, extra_key: Optional[str] = None,
              temperature: float = 0.0, timeout: float = 600.0, stop=None,
              logprob_start_len: Optional[int] = None, cache_salt: Optional[str] = None) -> dict:
    """One ``/generate`` call; with ``logprob_start_len`` the log-probabilities of the
    input tokens from there on and of the output tokens come back in ``meta_info``."""
    payload = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"temperature": temperature, "max_new_tokens": int(max_new_tokens)},
    }
    if logprob_start_len is not None:
        payload.update(return_logprob=True, logprob_start_len=int(logprob_start_len))
    if stop:
        payload["sampling_params"]["stop"] = stop
    if extra_key:
        payload["extra_key"] = extra_key
    if cache_salt:
        payload["cache_salt"] = cache_salt
    r = requests.post(base_url + "/generate", json=payload, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _logprobs(meta: dict, key: str) -> list[float]:
    """The log-probabilities of ``meta_info[key]`` (SGLang's ``[logprob, token id, text]``
    entries; the first input token's is None)."""
    return [float(e[0]) for e in meta.get(key) or () if e and e[0] is not None]


def _parallel(fns: list) -> list:
    """Run the calls on daemon threads (so SGLang batches them); results in order.
    (Not a ThreadPoolExecutor: its workers are joined at interpreter exit, which would
    hold up a server shutdown behind an in-flight request.)"""
    results: list = [None] * len(fns)
    errors: list = []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class ProfilerService:
    """Background profiling and drift checks, in idle time (see the module docstring)."""

    def __init__(self, client: ControlClient, base_url: str, tok: _Tokenizer, idle_seconds: float,
                 scorer=None, poll: float = 0.5, jobs_per_round: int = 4) -> None:
        self.client = client
        self.base_url = base_url
        self.tok = tok
        self.idle_seconds = idle_seconds
        self._scorer = scorer
        self._scorer_lock = threading.Lock()
        self.poll = poll
        self.jobs_per_round = jobs_per_round
        self._stop = threading.Event()

    @property
    def scorer(self):
        # Profiles run on several threads at once: the model loads once, under the lock
        # (three concurrent loads of MiniLM were seen before it was there).
        with self._scorer_lock:
            return self._load_scorer()

    def _load_scorer(self):
        if self._scorer is None:
            try:
                from .quality import EmbeddingScorer

                s = EmbeddingScorer()
                s.score("warm up", "warm up")
                self._scorer = s
            except ImportError as exc:
                from .quality import token_f1

                logger.warning("EvicPress: %s; scoring answers by token F1 instead", exc)
                self._scorer = token_f1
        return self._scorer

    def start(self) -> None:
        threading.Thread(target=self._run, name="evicpress-profiler", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    @staticmethod
    def _server_exiting() -> bool:
        """True once SGLang drains for shutdown (SIGTERM): issuing more requests would
        keep the drain waiting."""
        try:
            from sglang.srt.entrypoints import http_server

            state = http_server._global_state
            return bool(state is not None and getattr(state.tokenizer_manager, "gracefully_exit", False))
        except Exception:  # pragma: no cover - another SGLang layout
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._server_exiting():
                return
            try:
                if not self.step():
                    self._stop.wait(self.poll)
            except (requests.RequestException, ControlError):
                self._stop.wait(2.0)  # server starting or going away
            except Exception:
                logger.exception("EvicPress profiler step failed")
                self._stop.wait(5.0)

    def step(self) -> bool:
        """One round: True when it did work."""
        status = self.client.call("GET", "/status")
        if status["idle_seconds"] < self.idle_seconds or not (
            status["pending_profiles"] or status["pending_observations"]
        ):
            return False
        work = self.client.call("GET", "/work", params={"limit": self.jobs_per_round})

        def run(job):
            try:
                self.profile(job)
            except Exception:
                logger.exception("EvicPress: profiling context %s failed", job["ctx_id"])
                self.client.call("POST", "/work/profile", {"ctx_id": job["ctx_id"], "failed": True})

        # several contexts at once: SGLang batches their decodes
        _parallel([(lambda j=j: run(j)) for j in work["profiles"]])
        _parallel([(lambda o=o: self.observe(o)) for o in work["observations"]])
        return bool(work["profiles"] or work["observations"])

    # ------------------------------------------------------------------ jobs
    def _gen(self, ids, ns, max_new_tokens, **kw) -> dict:
        if self._server_exiting():
            raise RuntimeError("the server is shutting down")
        return _generate(self.base_url, ids, max_new_tokens=max_new_tokens, extra_key=ns, **kw)

    def _questions(self, job: dict) -> list[list[int]]:
        """Questions for a context registered without any, kept on the context (its
        query set from now on): built from its text, or written by the served model."""
        n = job["generate_queries"]
        if ProbeSource(job.get("profile_source", ProbeSource.CONTEXT)) is ProbeSource.CONTEXT:
            texts = context_probes(self.tok.decode(job["token_ids"]), n, seed_tokens=job["token_ids"])
        else:
            texts = self._written_questions(job, n)
        suffixes = [self.tok.encode(DEFAULT_TEMPLATE.format(query=q), special=False) for q in texts]
        self.client.call("POST", f"/contexts/{job['ctx_id']}/queries", {"suffixes": suffixes, "texts": texts})
        return [job["token_ids"] + s for s in suffixes]

    def _written_questions(self, job: dict, n: int) -> list[str]:
        ids = job["token_ids"] + self.tok.encode(QUESTION_PROMPT, special=False)
        outs = _parallel([
            (lambda i=i: self._gen(ids, ref_namespace(job["ctx_id"]), 24, temperature=0.7 + 0.1 * i, stop=["\n"]))
            for i in range(n)
        ])
        texts = []
        for o in outs:
            q = o["text"].strip().split("\n")[0].strip()
            if q and q not in texts:
                texts.append(q)
        return texts

    def profile(self, job: dict) -> dict:
        prompts = job["prompts"] or self._questions(job)
        if not prompts:
            raise RuntimeError(f"no queries to profile context {job['ctx_id']}")
        m = job["max_new_tokens"]
        likelihood = ProfileMetric(job.get("profile_metric", ProfileMetric.ANSWER)) is ProfileMetric.LIKELIHOOD
        refs = _parallel([
            (lambda p=p: self._gen(p, ref_namespace(job["ctx_id"]), m,
                                   **({"logprob_start_len": len(p) - 1} if likelihood else {})))
            for p in prompts
        ])
        labels = list(job["candidates"])
        if likelihood:  # the full-KV answer read over each config's KV: one forward, no decoding
            answers = _parallel([
                (lambda p=p, r=r, ns=variant_namespace(label, job["ctx_id"]):
                 # from the prompt's last token: SGLang gives the first input position None
                 self._gen(p + list(r["output_ids"]), ns, 1, logprob_start_len=len(p) - 1))
                for label in labels for p, r in zip(prompts, refs)
            ])
        else:
            answers = _parallel([
                (lambda p=p, ns=variant_namespace(label, job["ctx_id"]): self._gen(p, ns, m))
                for label in labels for p in prompts
            ])
        quality = {}
        for i, label in enumerate(labels):
            outs = answers[i * len(prompts): (i + 1) * len(prompts)]
            # the compressed context was loaded when (nearly) all of it was a cache hit
            loaded = all(
                o["meta_info"].get("cached_tokens", 0) >= 0.9 * min(len(job["token_ids"]), len(p) - 1)
                for o, p in zip(outs, prompts)
            )
            if not loaded:
                logger.warning("EvicPress: could not load %s of context %s for profiling", label, job["ctx_id"])
                continue
            if likelihood:
                scale = float(job.get("likelihood_scale", 1.0))
                scores = [likelihood_quality(_logprobs(r["meta_info"], "output_token_logprobs"),
                                             _logprobs(o["meta_info"], "input_token_logprobs"), scale)
                          for o, r in zip(outs, refs)]
            else:
                scores = [self._score(o["text"], r["text"]) for o, r in zip(outs, refs)]
            quality[label] = sum(scores) / len(scores)
        if not quality:
            raise RuntimeError(f"no candidate of context {job['ctx_id']} could be profiled")
        mono = monotone_profile({CompressionConfig.parse(k): v for k, v in quality.items()})
        quality = {cfg.label: q for cfg, q in mono.items()}
        self.client.call("POST", "/work/profile",
                         {"ctx_id": job["ctx_id"], "quality": quality, "reason": job["reason"]})
        return quality

    def _score(self, answer: str, reference: str) -> float:
        if not answer.strip() and not reference.strip():
            return 1.0
        return float(self.scorer(answer, reference))

    def observe(self, obs: dict) -> float:
        ref = self._gen(obs["prompt_ids"], ref_namespace(obs["ctx_id"]), max(1, len(obs["output_ids"])))
        q = self._score(self.tok.decode(obs["output_ids"]), ref["text"])
        self.client.call("POST", "/work/observation",
                         {"ctx_id": obs["ctx_id"], "config": obs["config"], "quality": q})
        return q
