"""SGLang's released wheel as the oracle, the static half: its route table and request structs
read with `ast` (tests/support/sglang_wheel.py), the checker itself on synthetic requests (a
misspelt field is named), the behaviour rules' locators still found in the wheel, and
docs/sglang.md's generated tables current. The other half, the project's real requests captured
through a proxy in front of a real engine, is tests/integration/test_sglang_conformance.py.

The wheel is fetched once into .cache/sglang/ (or read from $SLIME_ASYNC_SGLANG_WHEEL); without
a registry these tests skip, naming the command that failed.
"""

from __future__ import annotations

import copy
import dataclasses
import zipfile

import pytest

from tests.support import sglang_wheel as sw
from tests.support.sglang_rules import (
    COMMAND,
    DOC,
    RULES,
    Rule,
    RuleNotFound,
    doc_parts,
    locate_rule,
    render_tables,
    rules_table,
)
from tests.support.sglang_wheel import Captured, api_or_skip, check_request


@pytest.fixture(scope="module")
def api() -> sw.SGLangAPI:
    return api_or_skip()


def test_the_route_table_is_read(api):
    assert api.version == sw.VERSION, (
        f"{api.location} is SGLang {api.version}; tests/support/sglang_wheel.py VERSION is "
        f"{sw.VERSION}: set VERSION to the release being checked"
    )
    assert len(api.routes) > 40, sorted(api.routes)
    gen = api.routes["/generate"]
    assert (gen.methods, gen.struct, gen.auth) == (("POST", "PUT"), "GenerateReqInput", None)
    upd = api.routes["/update_weights_from_distributed"]
    assert (upd.methods, upd.auth) == (("POST",), "ADMIN_OPTIONAL")
    assert upd.struct == "UpdateWeightsFromDistributedReqInput"
    assert api.routes["/abort_request"].struct == "AbortReq"  # Annotated[AbortReq, Body()]
    assert api.routes["/flush_cache"].methods == ("GET", "POST")
    assert api.routes["/flush_cache"].query == ("timeout",)
    assert api.routes["/health"].methods == ("GET",) and api.routes["/health"].struct is None
    assert api.default_auth == "NORMAL" and api.auth_of("/model_info") == "NORMAL"
    assert api.open_path("/health_generate") and api.open_path("/ready")
    assert not api.open_path("/generate")


def test_structs_fields_defaults_and_bases(api):
    s = api.structs["UpdateWeightsFromDistributedReqInput"]
    assert s.required == ["names", "dtypes", "shapes"]
    assert s.fields["flush_cache"].default == "True"
    assert "rid" in s.fields  # from BaseReq, a base within io_struct.py
    gen = api.structs["GenerateReqInput"]
    assert gen.required == []
    assert gen.fields["rid"].default == "None"  # field(default=None, kw_only=True)
    assert api.structs["UpdateWeightVersionReqInput"].fields["abort_all_requests"].default == (
        "True"
    )
    assert {"max_new_tokens", "temperature", "stop_token_ids"} <= set(api.sampling_fields)
    assert api.contract_sampling is not None and "stop_strs" not in api.contract_sampling


SYNTHETIC_SERVER = """
@app.get("/ready")
async def ready(): ...

@app.api_route("/thing", methods=["POST", "PUT"])
@auth_level(AuthLevel.ADMIN_OPTIONAL)
async def thing(obj: Annotated[Optional[Child], Body()], request: Request, t: int = Query(0)): ...

@app.post(os.environ.get("SOME_ROUTE", "/env_route"))
async def env_route(obj: Base): ...
"""
SYNTHETIC_STRUCTS = """
class Base(msgspec.Struct):
    rid: Optional[str] = None
class Child(Base, kw_only=True):
    names: List[str]
    tags: list = field(default_factory=list)
    late: int = field(init=False, default=0)
    K: ClassVar[int] = 1
"""


def test_the_parsers_on_synthetic_sources():
    """Without the wheel: what each parser makes of each form it reads."""
    structs = sw.parse_structs(SYNTHETIC_STRUCTS)
    assert list(structs["Child"].fields) == ["rid", "names", "tags"]
    assert structs["Child"].required == ["names"]
    assert structs["Child"].fields["tags"].default == "list()"
    routes = sw.parse_routes(SYNTHETIC_SERVER, set(structs))
    assert routes["/ready"].methods == ("GET",) and routes["/ready"].auth is None
    thing = routes["/thing"]
    assert (thing.methods, thing.auth, thing.struct, thing.query) == (
        ("POST", "PUT"),
        "ADMIN_OPTIONAL",
        "Child",
        ("t",),
    )
    assert routes["/env_route"].struct == "Base"
    assert sw.parse_routes("def f(): pass\n", set()) == {}


def test_a_wheel_without_routes_fails_not_skips(tmp_path):
    for rel, text in {sw.IO_STRUCT: SYNTHETIC_STRUCTS, sw.HTTP_SERVER: "x = 1\n"}.items():
        (tmp_path / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sglang" / rel).write_text(text)
    with pytest.raises(sw.WheelError, match="yields no @app routes"):
        sw.load(tmp_path)


def gen(body: dict) -> Captured:
    return Captured("POST", "/generate", body, {"Authorization": "Bearer k"})


def test_the_checker_names_a_misspelt_field(api):
    """A field our code might misspell (SGLang's msgspec structs ignore unknown keys, so the
    server would run with the default): the checker names route, field, struct and its fields."""
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "flush_cach": False}
    verdict = check_request(api, Captured("POST", "/update_weights_from_distributed", body))
    fields = ", ".join(sorted(api.structs["UpdateWeightsFromDistributedReqInput"].fields))
    assert verdict.problems == [
        "POST /update_weights_from_distributed: field 'flush_cach' is not a field of "
        f"UpdateWeightsFromDistributedReqInput (fields: {fields})"
    ]
    print("\n".join(verdict.problems))


def test_the_checker_on_every_kind_of_problem(api):
    ok = gen({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "rid": "r"})
    assert check_request(api, ok).problems == []
    (p,) = check_request(
        api, gen({"input_ids": [1], "sampling_params": {"max_tokens": 2}})
    ).problems
    assert p.startswith("POST /generate: sampling_params key 'max_tokens' is not a field of ")
    # A key the scheduler's struct has but the JSON contract refuses (internal).
    (p,) = check_request(
        api, gen({"input_ids": [1], "sampling_params": {"stop_strs": "x"}})
    ).problems
    assert "not in the /generate contract's SamplingParams" in p
    batch = gen({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"best_of": 2}]})
    assert [p.split(" is ")[0] for p in check_request(api, batch).problems] == [
        "POST /generate: sampling_params key 'best_of'"
    ]
    (p,) = check_request(api, Captured("POST", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 1, "world_size": 2
    })).problems  # fmt: skip
    assert p == (
        "POST /init_weights_update_group: required field 'rank_offset' of "
        "InitWeightsUpdateGroupReqInput is missing"
    )
    assert check_request(api, Captured("GET", "/pause_generation")).problems == [
        "GET /pause_generation: /pause_generation answers POST, not GET"
    ]
    assert check_request(api, Captured("GET", "/get_weight_version")).problems == [
        f"GET /get_weight_version: SGLang {api.version} has no route /get_weight_version"
    ]
    (p,) = check_request(api, Captured("POST", "/flush_cache", None, query={"wait": "1"})).problems
    assert p.startswith("POST /flush_cache: query parameter 'wait' is not one of flush_cache's")
    (p,) = check_request(api, Captured("POST", "/flush_cache", {"timeout": 1})).problems
    assert "reads no JSON body" in p


def test_a_struct_that_lost_a_field_is_named(api):
    """As a bump that renamed `flush_cache` would look: the same request, now refused by name."""
    bumped = copy.copy(api)
    bumped.structs = dict(api.structs)
    s = copy.deepcopy(api.structs["UpdateWeightsFromDistributedReqInput"])
    del s.fields["flush_cache"]
    bumped.structs[s.name] = s
    body = {"names": [], "dtypes": [], "shapes": [], "flush_cache": False}
    req = Captured("POST", "/update_weights_from_distributed", body)
    assert check_request(api, req).problems == []
    (p,) = check_request(bumped, req).problems
    assert "field 'flush_cache' is not a field of UpdateWeightsFromDistributedReqInput" in p


def test_the_auth_level_is_noted(api):
    notes = check_request(api, Captured("POST", "/pause_generation", {"mode": "abort"})).notes
    assert notes == [
        "POST /pause_generation: ADMIN_OPTIONAL: only the admin key when the server has one, "
        "else the api key; sent no key"
    ]
    assert "open to all" in check_request(api, Captured("GET", "/health")).notes[0]


def test_every_behaviour_rule_is_still_in_the_wheel(api):
    """Each rule the strict embedded engine imitates, found again at its file and locator."""
    print("\n" + rules_table(api))
    for rule in RULES:
        assert locate_rule(api, rule) > 0


@pytest.mark.parametrize(
    "locator, message",
    [
        ("must run between begin() and end()", "no text"),
        ("def vanished_function", "no function vanished_function"),
        ("route POST /ready", "no POST /ready route"),
        ("field GenerateReqInput.extra_key=True", "defaults to None, not True"),
        ("field GenerateReqInput.no_such_key", "has no field no_such_key"),
    ],
)
def test_a_vanished_locator_fails(api, locator, message):
    rule = dataclasses.replace(RULES[0], locator=locator)
    with pytest.raises(RuleNotFound, match=message):
        locate_rule(api, rule)
    assert isinstance(rule, Rule)


def test_the_docs_tables_are_current(api):
    current = render_tables(api)
    for marker, table in doc_parts(DOC.read_text()).items():
        assert table == current[marker], (
            f"{DOC.name}'s table after {marker} is out of date: run `{COMMAND}` and paste it"
        )


def test_an_extracted_folder_reads_as_the_wheel(api, tmp_path, monkeypatch):
    """$SLIME_ASYNC_SGLANG_WHEEL may name a folder holding the extracted sglang/ package."""
    if not api.files.location.is_file():
        pytest.skip("the wheel in use is a folder already")
    with zipfile.ZipFile(api.files.location) as z:
        for rel in (sw.HTTP_SERVER, sw.AUTH, sw.IO_STRUCT, sw.SAMPLING, "_version.py"):
            z.extract(f"sglang/{rel}", tmp_path)
    monkeypatch.setenv(sw.ENV, str(tmp_path))
    folder = sw.load(sw.locate())
    assert folder.routes == api.routes and folder.structs == api.structs
    assert folder.contract_sampling is None  # api/v1 not extracted: only the scheduler's struct


def test_a_failed_download_skips_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv(sw.ENV, raising=False)
    monkeypatch.setattr(
        sw, "download_command", lambda dest, version=sw.VERSION: [
            sw.sys.executable, "-c", "import sys; sys.exit('no index reachable')", str(dest)
        ]
    )  # fmt: skip
    with pytest.raises(sw.WheelUnavailable, match=r"`python -c import sys.* failed \(exit 1\)"):
        sw.locate(cache=tmp_path)
    assert not list(tmp_path.glob("*.whl"))
