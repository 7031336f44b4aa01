"""Which key opens which route of the embedded engine: SGLang 0.5.23's three auth levels.

The rules are `srt/utils/auth.py: decide_request_auth`; each route's level is the `@auth_level`
of its handler in `srt/entrypoints/http_server.py` (routes without one are NORMAL). Honoured in
both modes (it is access control, not a failure imitation).
"""

from __future__ import annotations

import hmac
from enum import Enum


class Level(Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"


ROUTE_LEVELS: dict[str, Level] = {
    # http_server.py line: the route's handler and its @auth_level.
    "/generate": Level.NORMAL,  # 928 generate_request (no @auth_level)
    "/get_model_info": Level.NORMAL,  # 802
    "/model_info": Level.NORMAL,  # 812
    "/get_server_info": Level.NORMAL,  # 853
    "/server_info": Level.NORMAL,  # 863
    "/get_weight_version": Level.NORMAL,  # not in 0.5.23 (an older route; NORMAL there)
    "/flush_cache": Level.ADMIN_OPTIONAL,  # 1025-1026
    "/freeze_gc": Level.ADMIN_OPTIONAL,  # 1254-1255
    "/update_weights_from_disk": Level.ADMIN_OPTIONAL,  # 1300-1301
    "/init_weights_update_group": Level.ADMIN_OPTIONAL,  # 1404-1405
    "/destroy_weights_update_group": Level.ADMIN_OPTIONAL,  # 1420-1421
    "/begin_weight_update": Level.ADMIN_OPTIONAL,  # 1458-1459
    "/end_weight_update": Level.ADMIN_OPTIONAL,  # 1473-1474
    "/update_weights_from_distributed": Level.ADMIN_OPTIONAL,  # 1488-1489
    "/update_weight_version": Level.ADMIN_OPTIONAL,  # 1527-1528
    "/abort_request": Level.ADMIN_OPTIONAL,  # 1721-1722
    "/pause_generation": Level.ADMIN_OPTIONAL,  # 1831-1832
    "/continue_generation": Level.ADMIN_OPTIONAL,  # 1844-1845
}
"""Route -> SGLang's auth level; a route not listed (an unknown path: 404) is NORMAL."""

_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""auth.py: decide_request_auth lets these prefixes through with no key (probes, scraping)."""


def allowed(
    method: str, path: str, authorization: str | None, api_key: str | None, admin_key: str | None
) -> bool:
    """auth.py: decide_request_auth for NORMAL and ADMIN_OPTIONAL routes. A refusal is 401."""
    if method == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return True
    if ROUTE_LEVELS.get(path, Level.NORMAL) is Level.ADMIN_OPTIONAL:
        # With an admin key only it opens them (api_key is NOT accepted); else api_key; else open.
        key = admin_key or api_key
    else:
        # NORMAL: api_key when set (even with an admin key set); else open (admin key only too).
        key = api_key
    return not key or _bearer(authorization, key)


def _bearer(header: str | None, key: str) -> bool:
    """auth.py: `Bearer <token>` (scheme case-insensitive), compared in constant time."""
    if not header:
        return False
    parts = header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode(), key.encode())
