"""SpecCache's HTTP API: ``POST /speccache/chunks`` registers chunks ahead of the
requests that will bring them: ``{"chunks": ["text", ...]}`` -> each is fetched
(:mod:`.fetch`), whether or not it was before: prefilled alone the first time, its KV then
cached in the radix tree (and, with HiCache, backed up to the host and storage tiers);
found, or loaded back to the device, afterwards. Answers ``{"chunks": n, "tokens":
[...], "sources": ["computed" | "device" | "host" | "storage", ...]}``; a malformed body
is a 400."""

from __future__ import annotations

from typing import Any

from sglang_vc.config import VCConfig

from .names import GROUP


def install(vc_config: VCConfig) -> None:
    if vc_config.group(GROUP) is None:
        return
    from fastapi import Body, HTTPException
    from sglang.srt.entrypoints import http_server

    from .frontend import frontend_for

    async def register(body: Any = Body(...)):
        frontend = frontend_for(http_server.get_global_state().tokenizer_manager)
        try:
            ids = frontend.chunk_ids_of(body.get("chunks") if isinstance(body, dict) else None)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        sources = await frontend.fetch(ids, force=True)
        return {"chunks": len(ids), "tokens": [len(i) for i in ids], "sources": [s.value for s in sources]}

    http_server.app.add_api_route("/speccache/chunks", register, methods=["POST"])
