"""Which key opens which embedded-engine route: SGLang 0.5.23's auth levels
(srt/utils/auth.py: decide_request_auth), every combination of api_key and admin_api_key."""

import pytest

from slime_async.actors.engine.embedded.auth import ROUTE_LEVELS, Level, allowed
from tests.support import sglang_wheel as sw

API, ADMIN = "api", "admin"


def _ok(path: str, key: str | None, api_key: str | None, admin_key: str | None) -> bool:
    header = None if key is None else f"Bearer {key}"
    return allowed("POST", path, header, api_key, admin_key)


@pytest.mark.parametrize(
    ("api_key", "admin_key", "key", "normal", "admin"),
    [
        # no keys configured: everything open
        (None, None, None, True, True),
        # only api_key: it opens both levels
        (API, None, API, True, True),
        (API, None, None, False, False),
        # only admin_api_key: NORMAL routes open, admin routes take only the admin key
        (None, ADMIN, None, True, False),
        (None, ADMIN, ADMIN, True, True),
        # both: NORMAL takes only api_key, admin routes only the admin key
        (API, ADMIN, API, True, False),
        (API, ADMIN, ADMIN, False, True),
        (API, ADMIN, "wrong", False, False),
    ],
)
def test_levels_as_sglang(api_key, admin_key, key, normal, admin):
    assert _ok("/generate", key, api_key, admin_key) is normal
    assert _ok("/update_weights_from_distributed", key, api_key, admin_key) is admin
    assert _ok("/begin_weight_update", key, api_key, admin_key) is admin


def test_probes_need_no_key_and_bearer_is_parsed_as_sglang():
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert allowed("GET", path, None, API, ADMIN)
    assert allowed("OPTIONS", "/generate", None, API, ADMIN)
    assert allowed("POST", "/generate", "bearer api", API, None)  # scheme case-insensitive
    assert not allowed("POST", "/generate", "Bearerapi", API, None)
    assert not allowed("POST", "/generate", "Basic api", API, None)


def test_every_control_route_is_admin_optional():
    admin = {p for p, level in ROUTE_LEVELS.items() if level is Level.ADMIN_OPTIONAL}
    assert admin == {
        "/flush_cache",
        "/freeze_gc",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }


def test_each_route_has_the_wheels_level():
    """Every route of ROUTE_LEVELS that SGLang 0.5.23 serves has the level of its handler's
    @auth_level in the wheel's http_server.py (NORMAL where it has none)."""
    api = sw.api_or_skip()
    served = {p: level for p, level in ROUTE_LEVELS.items() if p in api.routes}
    assert set(ROUTE_LEVELS) - set(served) == {"/get_weight_version"}  # not in 0.5.23
    for path, level in served.items():
        assert api.auth_of(path) == level.name, path
