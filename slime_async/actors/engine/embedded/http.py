"""HTTP pieces the embedded engine's route modules share: the client-error type, error answers
and JSON body reading (server.py, weights.py, control.py)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class BadRequest(ValueError):
    """A client error: answered with 400 and its message."""


def error(status: int, message: str) -> web.Response:
    """SGLang's error shape: `{"error": {"message": ...}}`."""
    return web.json_response({"error": {"message": message}}, status=status)


def fail(message: str, **extra: Any) -> web.Response:
    """A refused control call, as SGLang answers it: 400 with success false and the reason."""
    return web.json_response({"success": False, "message": message, **extra}, status=400)


async def read_body(request: web.Request, required: bool = True) -> dict[str, Any]:
    """The request's JSON object; a body-less POST is a 400 when `required`."""
    raw = await request.read()
    if not raw:
        if required:
            raise BadRequest(f"{request.path} needs a JSON body ({{}} at least)")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body
