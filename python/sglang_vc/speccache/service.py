"""SpecCache's HTTP API: ``POST /speccache/chunks`` registers chunks ahead of the
requests that will bring them: ``{"chunks": ["text", ...]}`` -> each is prefilled alone
and its KV cached in the radix tree (a request bringing an unregistered chunk registers
it the same way first); chunks registered before are skipped unless ``"force": true``.
Answers ``{"chunks": n, "new": m, "tokens": [...]}``; a
malformed body is a 400."""

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
        new = await frontend.register(ids, force=bool(body.get("force", False)))
        return {"chunks": len(ids), "registered": new, "tokens": [len(i) for i in ids]}

    http_server.app.add_api_route("/speccache/chunks", register, methods=["POST"])
