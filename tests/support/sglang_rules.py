"""The project's side of the SGLang oracle: the requests it sends, and the SGLang behaviour rules
the embedded engine's strict mode imitates, each pinned to a locator in the wheel.

    python -m tests.support.sglang_rules           # prints docs/sglang.md's two generated tables
    python -m tests.support.sglang_rules --write   # ... and writes them into docs/sglang.md

`PROJECT_ROUTES` is what the project sends (the capture test fails on a captured request that is
not listed here, and on a listed one that no code path sent); `RULES` are facts of SGLang's code
that the project relies on, each found again in the wheel by `locate_rule` (the unit test fails
when a locator vanishes, so a version bump re-checks every rule). `render_tables` writes both as
markdown; `tests/unit/engine/test_sglang_wheel.py` checks docs/sglang.md holds them verbatim.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass

from tests.support.repo import REPO
from tests.support.sglang_wheel import HTTP_SERVER, IO_STRUCT, SGLangAPI, routes_table, sglang_api

DOC = REPO / "docs" / "sglang.md"
ROUTES_BEGIN, ROUTES_END = "<!-- routes:begin -->", "<!-- routes:end -->"
RULES_BEGIN, RULES_END = "<!-- rules:begin -->", "<!-- rules:end -->"
COMMAND = "python -m tests.support.sglang_rules --write"


@dataclass(frozen=True)
class ProjectRoute:
    method: str
    path: str
    sender: str
    """The code that sends it."""
    older_only: bool = False
    """A fall-back for servers older than the checked release: absent from its wheel."""


PROJECT_ROUTES = [
    ProjectRoute("POST", "/generate", "`EngineClient.generate` (generators, via `EnginePool`)"),
    ProjectRoute("GET", "/ready", "`EngineProbe` (every role's liveness watch)"),
    ProjectRoute("GET", "/health", "`EngineProbe` where /ready is missing; `EngineClient.health`"),
    ProjectRoute("GET", "/health_generate", "`EngineClient.health_generate`"),
    ProjectRoute("GET", "/model_info", "`WeightPusher` probe; `EngineClient.get_weight_version`"),
    ProjectRoute("GET", "/get_model_info", "`WeightPusher` probe where /model_info is missing"),
    ProjectRoute("GET", "/server_info", "`WeightPusher` (ranks, device); `get_server_info`"),
    ProjectRoute("GET", "/get_server_info", "`EngineClient.get_server_info` fall-back"),
    ProjectRoute(
        "GET",
        "/get_weight_version",
        "`EngineClient.get_weight_version` where /model_info has no version",
        older_only=True,
    ),
    ProjectRoute("POST", "/pause_generation", "`WeightPusher` (push.pause_mode)"),
    ProjectRoute("POST", "/flush_cache", "`WeightPusher` (abort, retract pauses), polled"),
    ProjectRoute("POST", "/continue_generation", "`WeightPusher`"),
    ProjectRoute("POST", "/init_weights_update_group", "`WeightPusher.connect`"),
    ProjectRoute("POST", "/begin_weight_update", "`WeightPusher.push`, before the first bucket"),
    ProjectRoute("POST", "/end_weight_update", "`WeightPusher.push`, after the last (always)"),
    ProjectRoute("POST", "/update_weights_from_distributed", "`WeightPusher.push`, per bucket"),
    ProjectRoute("POST", "/destroy_weights_update_group", "`WeightPusher` (rebuild, close)"),
    ProjectRoute("POST", "/update_weights_from_disk", "`EngineClient.update_weights_from_disk`"),
    ProjectRoute("POST", "/update_weight_version", "`EngineClient.update_weight_version`"),
    ProjectRoute("POST", "/abort_request", "`EngineClient.abort`"),
]

SCHEDULER_UPDATER = "srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"
CONTROL = "srt/managers/tokenizer_control_mixin.py"


@dataclass(frozen=True)
class Rule:
    key: str
    rule: str
    file: str
    locator: str
    """`def NAME` (a function), `route METHOD PATH`, `field STRUCT.NAME[=DEFAULT]`, or text
    (a distinctive string of the file; its first line is reported)."""


RULES = [
    Rule(
        "a",
        "`/update_weights_from_distributed` and `/update_weights_from_tensor` outside a weight-update "
        "session (`/begin_weight_update` .. `/end_weight_update`) answer 400 `success: false`, "
        '"... must run between begin_weight_update() and end_weight_update()", before receiving '
        "anything (the engine never joins the broadcast)",
        SCHEDULER_UPDATER,
        "must run between ",
    ),
    Rule(
        "b",
        "`/health` and `/health_generate` submit a one-token generation (`max_new_tokens` 1) and "
        "check for an answer once a second: 200 no sooner than 1 s, 503 when nothing came back "
        "within `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s); no key needed",
        HTTP_SERVER,
        "def health_generate",
    ),
    Rule(
        "b2",
        "`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` defaults to true; false makes `/health` (not "
        "`/health_generate`) answer 200 at once",
        "srt/environ.py",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)",
    ),
    Rule(
        "c",
        "ADMIN_OPTIONAL routes: with an admin key set only the admin key unlocks them (the api key "
        "does not); with only an api key, that key; with none, open. NORMAL routes need the api "
        "key when one is set. `/health*`, `/ready*`, `/metrics*` need no key",
        "srt/utils/auth.py",
        "def decide_request_auth",
    ),
    Rule(
        "d",
        "`/update_weight_version` aborts every running request unless the body says "
        "`abort_all_requests: false` (its default is true)",
        IO_STRUCT,
        "field UpdateWeightVersionReqInput.abort_all_requests=True",
    ),
    Rule(
        "e",
        "An update with `flush_cache: true` (the default) whose flush is refused (requests running "
        'or queued) answers 400 "Weights were updated, but the cache was not flushed ...": the '
        "weights are loaded and the version recorded; the server keeps running",
        SCHEDULER_UPDATER,
        "Weights were updated, but the cache was not flushed",
    ),
    Rule(
        "f",
        "An engine joins the update group as rank `rank_offset + tp_rank`",
        RUNNER_UPDATER,
        "rank = rank_offset + self.tp_rank",
    ),
    Rule(
        "f2",
        "Update-group calls assert `dp_size == 1` (data-parallel replicas are not supported)",
        CONTROL,
        "assert get_parallel().dp_size == 1",
    ),
    Rule(
        "g",
        "`/generate` checks its body against the JSON contract first (400 `{error}`): unknown "
        "top-level keys are ignored",
        "api/v1/api_types.py",
        '"""sglang.api.v1.GenerateRequest: JSON object (unknown keys ignored)."""',
    ),
    Rule(
        "g2",
        "... unknown `sampling_params` keys are refused (400 naming the key)",
        "api/v1/api_types.py",
        '"""sglang.api.v1.SamplingParams: JSON object (unknown keys rejected)."""',
    ),
    Rule(
        "h",
        "`GenerateReqInput` has `extra_key` (default None)",
        IO_STRUCT,
        "field GenerateReqInput.extra_key=None",
    ),
    Rule(
        "i",
        "`GET /ready` exists: 200 when the server takes requests, 503 while paused or starting",
        HTTP_SERVER,
        "route GET /ready",
    ),
    Rule(
        "i2",
        "... (`is_ready`: not paused and healthy)",
        "srt/managers/tokenizer_manager.py",
        "return not self.is_pause and self.is_healthy()",
    ),
]


class RuleNotFound(AssertionError):
    pass


def locate_rule(api: SGLangAPI, rule: Rule) -> int:
    """The line of `rule.locator` in `rule.file` of the wheel; RuleNotFound names what is gone."""
    where = f"rule ({rule.key}): {rule.file}"
    if rule.locator.startswith("route "):
        _, method, path = rule.locator.split(" ", 2)
        route = api.routes.get(path)
        if route is None or method not in route.methods:
            raise RuleNotFound(f"{where}: no {method} {path} route")
        return route.line
    if rule.locator.startswith("field "):
        spec = rule.locator.removeprefix("field ")
        name, _, default = spec.partition("=")
        struct_name, _, field_name = name.partition(".")
        struct = api.structs.get(struct_name)
        f = struct.fields.get(field_name) if struct else None
        if f is None:
            raise RuleNotFound(f"{where}: {struct_name} has no field {field_name}")
        if default and f.default != default:
            raise RuleNotFound(f"{where}: {name} defaults to {f.default}, not {default}")
        return f.line
    text = api.files.read(rule.file)
    if rule.locator.startswith("def "):
        fname = rule.locator.removeprefix("def ")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == fname:
                return node.lineno
        raise RuleNotFound(f"{where}: no function {fname}")
    m = re.search(re.escape(rule.locator), text)
    if m is None:
        raise RuleNotFound(f"{where}: no text {rule.locator!r}")
    return text.count("\n", 0, m.start()) + 1


def rules_table(api: SGLangAPI) -> str:
    """The rules with their files as SGLang's source tree names them (the wheel's `sglang/`)."""
    rows = [
        f"| | SGLang {api.version} rule | File | Locator | Line |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in RULES:
        loc = r.locator.replace("|", "\\|")
        line = locate_rule(api, r)
        rows.append(f"| {r.key} | {r.rule} | `python/sglang/{r.file}` | `{loc}` | {line} |")
    return "\n".join(rows) + "\n"


def render_tables(api: SGLangAPI) -> dict[str, str]:
    """{marker pair: table} of docs/sglang.md's generated parts."""
    used = [(r.method, r.path, r.sender) for r in PROJECT_ROUTES]
    return {
        ROUTES_BEGIN: routes_table(api, used),
        RULES_BEGIN: rules_table(api),
    }


def doc_parts(text: str) -> dict[str, str]:
    """The text between each begin/end marker pair of docs/sglang.md."""
    out = {}
    for begin, end in ((ROUTES_BEGIN, ROUTES_END), (RULES_BEGIN, RULES_END)):
        if begin not in text or end not in text:
            raise AssertionError(f"{DOC.name} lacks the markers {begin} .. {end}")
        out[begin] = text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"
    return out


def rewrite_doc(api: SGLangAPI) -> None:
    """Replace docs/sglang.md's generated tables with the current ones."""
    text = DOC.read_text()
    for begin, table in render_tables(api).items():
        end = ROUTES_END if begin == ROUTES_BEGIN else RULES_END
        before, rest = text.split(begin, 1)
        text = before + begin + "\n" + table + end + rest.split(end, 1)[1]
    DOC.write_text(text)


def main(argv: list[str]) -> None:
    """Print the tables; with --write, put them into docs/sglang.md."""
    api = sglang_api()
    if "--write" in argv:
        rewrite_doc(api)
        return
    for begin, table in render_tables(api).items():
        end = ROUTES_END if begin == ROUTES_BEGIN else RULES_END
        sys.stdout.write(f"{begin}\n{table}{end}\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
