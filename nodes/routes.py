"""The pack's HTTP route: ``GET /sdvg/models`` says what this pack holds in memory.

One entry per loaded model — kind, file, the device it runs on, where its weights are now, its size, and whether
ComfyUI's memory manager has it loaded (what *Unload Models* acts on) — plus the server process's resident memory.
Read-only; the web UI or a script can poll it, and the host tests use it to watch ``/free`` work.
"""

from __future__ import annotations

from . import _host, _models

ROUTE = "/sdvg/models"
_registered = False


def models_payload() -> dict:
    entries = []
    for m in _models.loaded():
        where = m.loaded_device()
        entries.append({"kind": m.kind, "file": m.name, "device": str(m.device), "bytes": m.nbytes,
                        "weights_on": str(where) if where is not None else None,
                        "comfy_loaded": _host.is_loaded_by_host(m.patcher)})
    return {"models": entries, "rss_bytes": _host.process_rss_bytes()}


def register() -> None:
    """Add the route to ComfyUI's server (once; nothing without a server)."""
    global _registered
    server = _host.prompt_server()
    routes = getattr(server, "routes", None)
    if _registered or routes is None:
        return
    from aiohttp import web

    @routes.get(ROUTE)
    async def _models_route(request):
        return web.json_response(models_payload())

    _registered = True
