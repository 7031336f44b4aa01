"""The push's reading of SGLang 0.5.23: which routes take the admin key (http_server.py's
ADMIN_OPTIONAL routes) and which engine layouts its weight-update group covers."""

import pytest

from slime_async.actors.engine.client import ADMIN_ROUTES, EngineClient, is_admin_route
from slime_async.actors.engine.push_session import EngineLayoutError, engine_layout, engine_ranks
from tests.support import sglang_wheel as sw


def test_the_admin_key_goes_with_the_admin_routes_only():
    c = EngineClient("http://e", api_key="k", admin_api_key="a")
    for path in ("/pause_generation", "/begin_weight_update", "/flush_cache", "/abort_request"):
        assert c.key_for(path) == "a", path
    assert c.key_for("/dumper/start") == "a"
    for path in ("/generate", "/model_info", "/server_info", "/health", "/v1/chat/completions"):
        assert c.key_for(path) == "k", path
    plain = EngineClient("http://e", api_key="k")
    assert plain.key_for("/pause_generation") == "k" and plain.key_for("/generate") == "k"
    assert EngineClient("http://e").key_for("/pause_generation") is None
    assert is_admin_route("/flush_cache?timeout=1")


def test_admin_routes_match_the_wheel():
    """The client's admin routes are exactly the wheel's ADMIN_OPTIONAL routes (the dumper's
    templated route aside: the client matches its prefix)."""
    api = sw.api_or_skip()
    marked = {path for path, route in api.routes.items() if route.auth == "ADMIN_OPTIONAL"}
    assert marked - {"/dumper/{method}"} == set(ADMIN_ROUTES)


def test_layouts():
    assert engine_ranks("e", {"tp_size": 4, "pp_size": 1, "dp_size": 1}) == 4
    assert engine_ranks("e", {}) == 1
    # attention DP is inside the TP ranks (0.5.23 and the deprecated spelling)
    assert engine_ranks("e", {"tp_size": 4, "dp_size": 1, "attn_dp_size": 2}) == 4
    assert engine_layout({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}) == (4, 1, 1, 2)
    with pytest.raises(
        EngineLayoutError, match=r"engine e: refused: its layout \(tp_size=2, pp_size=2"
    ):
        engine_ranks("e", {"tp_size": 2, "pp_size": 2})
    with pytest.raises(EngineLayoutError, match=r"dp_size=2, attn_dp_size=2\).*replica"):
        engine_ranks("e", {"tp_size": 4, "dp_size": 2, "attn_dp_size": 2})
