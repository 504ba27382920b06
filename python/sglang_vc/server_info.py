"""The ``sglang_vc`` section of ``GET /server_info`` (and its deprecated alias
``/get_server_info``): version, platform, enabled mechanisms with their settings, and the
live counters that the scheduler processes report in their internal state."""

from __future__ import annotations

from typing import Any

from sglang_vc import __version__, stats
from sglang_vc.config import VCConfig

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


def static_section(vc_config: VCConfig) -> dict[str, Any]:
    from sglang.srt.platforms import current_platform

    return {
        "version": __version__,
        "platform": type(current_platform).__name__,
        "device": current_platform.device_type,
        "mechanisms": vc_config.enabled_mechanisms(),
        "switched_off": vc_config.switched_off,
    }


def install_server_info_routes(vc_config: VCConfig) -> None:
    """Wrap SGLang's server-info routes on its FastAPI app.

    FastAPI freezes a route's endpoint when the route is added, so the routes are
    re-registered (ours first) rather than patched."""
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    section = static_section(vc_config)
    originals = {
        route.path: route.endpoint
        for route in app.router.routes
        if isinstance(route, APIRoute) and route.path in SERVER_INFO_PATHS
    }
    app.router.routes[:] = [
        r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path in originals)
    ]
    for path, original in originals.items():
        app.add_api_route(path, _with_vc_section(original, section), methods=["GET"])


def _with_vc_section(original, section: dict[str, Any]):
    async def endpoint():
        info = await original()
        per_scheduler = [
            state.get("sglang_vc", {}) for state in info.get("internal_states", [])
        ]
        # the front end (this process) counts too: SpecCache's scoring and registrations
        info["sglang_vc"] = {**section, "counters": stats.merge(per_scheduler + [stats.snapshot()])}
        return info

    return endpoint
