"""SGLang's released wheel as a test oracle: its HTTP routes and request structs, read with `ast`.

    wheel = sglang_api()                # session-wide; downloads sglang==0.5.23 once
    wheel.routes["/generate"].methods   # ("POST", "PUT")
    check_request(wheel, captured)      # -> Verdict(problems, notes) for one recorded request

Where the wheel comes from: the `SLIME_ASYNC_SGLANG_WHEEL` environment variable (a `.whl` file,
or a folder holding the extracted `sglang/` package, or that package folder itself), else
`<repo>/.cache/sglang/sglang-<version>-*.whl`, else `python -m pip download --no-deps
sglang==<version>` into that folder (once; a file lock serialises pytest-xdist workers). The
members are read straight out of the zip: nothing is extracted into the checkout and SGLang is
never imported. A download that fails raises `WheelUnavailable` (the tests skip, naming the
command); a wheel that reads but yields no routes or lacks a struct raises `WheelError` (fail).

What is read (file: what):
- `srt/entrypoints/http_server.py`: every `@app.get/post/put/delete/api_route(path,
  methods=[...])` handler, its `@auth_level(AuthLevel.X)`, and the handler parameter whose
  annotation names an `io_struct` request struct (`obj: GenerateReqInput`,
  `Annotated[AbortReq, Body()]`), and its `Query(...)` parameters.
- `srt/utils/auth.py`: the level of an undecorated route (the `else AuthLevel.X` of
  `_get_auth_level_from_app_and_scope`) and the path prefixes `decide_request_auth` lets
  through without a key (`path.startswith(...)`).
- `srt/managers/io_struct.py`: each class's annotated fields, defaults (a literal, `None`,
  `field(default=...)`, `field(default_factory=...)`), required fields (no default), and the
  fields of its bases within the module.
- `srt/sampling/sampling_params.py` `SamplingParams` (its `__init__` parameters, or, as in
  0.5.23, its msgspec fields) and `api/v1/api_types.py` `SamplingParams` / `GenerateRequest`
  (the JSON contract `/generate` checks first: unknown sampling keys rejected).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.repo import REPO

VERSION = "0.5.23"
"""The SGLang release the project is checked against."""
ENV = "SLIME_ASYNC_SGLANG_WHEEL"
CACHE = REPO / ".cache" / "sglang"
DOWNLOAD_TAGS = (
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_34_x86_64",
)
"""One fixed wheel whatever Python runs the tests (the Python files are the same in every tag)."""

HTTP_SERVER = "srt/entrypoints/http_server.py"
AUTH = "srt/utils/auth.py"
IO_STRUCT = "srt/managers/io_struct.py"
SAMPLING = "srt/sampling/sampling_params.py"
CONTRACT = "api/v1/api_types.py"
HTTP_VERBS = ("get", "post", "put", "delete", "patch", "head")


class WheelUnavailable(RuntimeError):
    """The wheel could not be fetched (no registry): the oracle tests skip with this message."""


class WheelError(RuntimeError):
    """The wheel was read but is not what this module expects (a bump moved something): fail."""


# ---- where the files come from -------------------------------------------------------------


class WheelFiles:
    """Text of the `sglang/` package's members, from a wheel file or an extracted folder."""

    def __init__(self, location: Path):
        self.location = location
        self._zip = zipfile.ZipFile(location) if location.is_file() else None
        if self._zip is None:
            pkg = location / "sglang" if (location / "sglang").is_dir() else location
            if not (pkg / "srt").is_dir():
                raise WheelError(f"{location} holds no sglang package (no srt/ folder)")
            self._dir = pkg

    def has(self, rel: str) -> bool:
        if self._zip is not None:
            return f"sglang/{rel}" in self._zip.NameToInfo
        return (self._dir / rel).is_file()

    def read(self, rel: str) -> str:
        """The text of `sglang/<rel>`; WheelError names the member when it is missing."""
        try:
            if self._zip is not None:
                return self._zip.read(f"sglang/{rel}").decode()
            return (self._dir / rel).read_text()
        except (KeyError, FileNotFoundError):
            raise WheelError(f"{self.location} has no sglang/{rel}") from None


def download_command(dest: Path, version: str = VERSION) -> list[str]:
    return [
        sys.executable,
        *("-m", "pip", "download", "--no-deps", "--quiet", "--retries", "2", "--timeout", "30"),
        f"sglang=={version}",
        *DOWNLOAD_TAGS,
        *("-d", str(dest)),
    ]


def cached_wheel(cache: Path = CACHE, version: str = VERSION) -> Path | None:
    for path in sorted(cache.glob(f"sglang-{version}-*.whl")):
        if zipfile.is_zipfile(path):
            return path
    return None


def locate(cache: Path = CACHE, version: str = VERSION, timeout_s: float = 300.0) -> Path:
    """The wheel (file or folder) to read: $SLIME_ASYNC_SGLANG_WHEEL, the cached download, or a
    fresh `pip download` into `cache` under a file lock (so parallel workers download once)."""
    if os.environ.get(ENV):
        path = Path(os.environ[ENV]).expanduser()
        if not path.exists():
            raise WheelError(f"{ENV}={path}: no such file or folder")
        return path
    if found := cached_wheel(cache, version):
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if found := cached_wheel(cache, version):  # another worker fetched it meanwhile
            return found
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
            cmd = download_command(Path(tmp), version)
            shown = " ".join(["python", *cmd[1:-1], str(cache)])  # the folder, not the temp one
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise WheelUnavailable(f"`{shown}` gave no answer in {timeout_s:.0f}s") from None
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise WheelUnavailable(
                    f"`{shown}` failed (exit {done.returncode}): {' | '.join(tail)}; set {ENV} "
                    "to a wheel file or an extracted sglang folder to run these tests offline"
                )
            target = cache / wheels[0].name
            shutil.move(str(wheels[0]), target)
            return target


# ---- what the files say --------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    name: str
    required: bool
    default: str | None
    """The default as written in the source (`None`, `True`, `list()`, ...); None when required."""
    line: int = 0


@dataclass
class Struct:
    name: str
    line: int
    bases: list[str]
    fields: dict[str, Field] = field(default_factory=dict)
    """Own and inherited (from bases within the module) fields, the bases' first."""

    @property
    def required(self) -> list[str]:
        return [f.name for f in self.fields.values() if f.required]


@dataclass
class Route:
    path: str
    methods: tuple[str, ...]
    handler: str
    line: int
    auth: str | None
    """The `@auth_level` level (NORMAL, ADMIN_OPTIONAL, ADMIN_FORCE); None when undecorated."""
    struct: str | None
    """The request struct the handler's body parameter is annotated with."""
    query: tuple[str, ...] = ()


@dataclass
class SGLangAPI:
    """The parsed facts of one wheel."""

    version: str
    location: str
    routes: dict[str, Route]
    structs: dict[str, Struct]
    default_auth: str
    open_prefixes: tuple[str, ...]
    """Paths `decide_request_auth` lets through without any key (/health, /ready, ...)."""
    sampling_fields: dict[str, Field]
    """srt/sampling/sampling_params.py SamplingParams (what the scheduler builds)."""
    contract_sampling: dict[str, Field] | None
    """api/v1/api_types.py SamplingParams (what /generate's contract check lets in), if any."""
    files: WheelFiles = field(repr=False)

    def auth_of(self, path: str) -> str:
        route = self.routes[path]
        return route.auth or self.default_auth

    def open_path(self, path: str) -> bool:
        return path.startswith(self.open_prefixes)


def _literal(node: ast.AST | None) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def _path_of(node: ast.AST) -> str | None:
    """A route path: a string literal, or the default of `os.environ.get(NAME, "/default")`."""
    value = _literal(node)
    if isinstance(value, str):
        return value
    if isinstance(node, ast.Call) and len(node.args) == 2:
        return _path_of(node.args[1])
    return None


def _names(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def parse_routes(source: str, struct_names: set[str]) -> dict[str, Route]:
    """http_server.py's route table: one Route per path (methods merged over handlers)."""
    routes: dict[str, Route] = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        found: list[tuple[str, tuple[str, ...], int]] = []
        level = None
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            f = dec.func
            if isinstance(f, ast.Name) and f.id == "auth_level" and dec.args:
                arg = dec.args[0]
                level = arg.attr if isinstance(arg, ast.Attribute) else None
            if not (isinstance(f, ast.Attribute) and _names(f.value) == ["app"] and dec.args):
                continue
            path = _path_of(dec.args[0])
            if path is None:
                continue
            if f.attr in HTTP_VERBS:
                found.append((path, (f.attr.upper(),), dec.lineno))
            elif f.attr == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = _literal(kw.get("methods")) or ["GET"]  # FastAPI's default
                found.append((path, tuple(m.upper() for m in methods), dec.lineno))
        if not found:
            continue
        struct, query = None, []
        args = fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults
        defaults += fn.args.kw_defaults
        for arg, default in zip(args, defaults, strict=True):
            known = (
                [n for n in _names(arg.annotation) if n in struct_names] if arg.annotation else []
            )
            if known and struct is None:
                struct = known[0]
            elif isinstance(default, ast.Call) and "Query" in _names(default.func):
                query.append(arg.arg)
        for path, methods, line in found:
            old = routes.get(path)
            merged = tuple(dict.fromkeys((old.methods if old else ()) + methods))
            routes[path] = Route(path, merged, fn.name, line, level, struct, tuple(query))
    return routes


def _field_default(value: ast.AST | None) -> tuple[bool, str | None, bool]:
    """(required, default as source, init) of one annotated class attribute."""
    if value is None:
        return True, None, True
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
        kw = {k.arg: k.value for k in value.keywords}
        init = _literal(kw.get("init")) is not False
        if "default" in kw:
            return False, ast.unparse(kw["default"]), init
        if "default_factory" in kw:
            return False, f"{ast.unparse(kw['default_factory'])}()", init
        return True, None, init
    return False, ast.unparse(value), True


def parse_structs(source: str) -> dict[str, Struct]:
    """Every module-level class: its fields with defaults, bases within the module folded in."""
    tree = ast.parse(source)
    own: dict[str, Struct] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        s = Struct(node.name, node.lineno, [ast.unparse(b).split(".")[-1] for b in node.bases])
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            if "ClassVar" in _names(item.annotation):
                continue
            required, default, init = _field_default(item.value)
            if init:
                s.fields[item.target.id] = Field(item.target.id, required, default, item.lineno)
        own[s.name] = s

    @functools.cache
    def resolved(name: str) -> dict[str, Field]:
        out: dict[str, Field] = {}
        for base in own[name].bases:
            if base in own:
                out.update(resolved(base))
        out.update(own[name].fields)
        return out

    return {n: Struct(s.name, s.line, s.bases, dict(resolved(n))) for n, s in own.items()}


def parse_sampling(source: str, cls: str = "SamplingParams") -> dict[str, Field]:
    """`cls`'s `__init__` parameters (with their defaults), else its annotated fields."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    params = a.args[1:] + a.kwonlyargs
                    defaults = [None] * (len(a.args) - 1 - len(a.defaults)) + a.defaults
                    defaults += a.kw_defaults
                    return {
                        p.arg: Field(p.arg, d is None, ast.unparse(d) if d else None, p.lineno)
                        for p, d in zip(params, defaults, strict=True)
                    }
            return parse_structs(source)[cls].fields
    raise WheelError(f"no class {cls}")


def parse_auth(source: str) -> tuple[str, tuple[str, ...]]:
    """(the level of an undecorated route, the path prefixes that need no key) from auth.py."""
    tree = ast.parse(source)
    default, prefixes = None, []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if fn.name == "_get_auth_level_from_app_and_scope":
            for node in ast.walk(fn):
                if isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Attribute):
                    default = node.orelse.attr
        if fn.name == "decide_request_auth":
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "startswith"
                    and _names(node.func.value) == ["path"]
                ):
                    prefixes.append(_literal(node.args[0]))
    if default is None:
        raise WheelError(f"{AUTH}: no default auth level in _get_auth_level_from_app_and_scope")
    return default, tuple(p for p in prefixes if isinstance(p, str))


def load(location: Path) -> SGLangAPI:
    """Parse the wheel (file or folder) at `location`."""
    files = WheelFiles(location)
    structs = parse_structs(files.read(IO_STRUCT))
    routes = parse_routes(files.read(HTTP_SERVER), set(structs))
    if not routes:
        raise WheelError(f"{location}: {HTTP_SERVER} yields no @app routes")
    default_auth, prefixes = parse_auth(files.read(AUTH))
    version = "unknown"
    with contextlib.suppress(WheelError):
        for node in ast.parse(files.read("_version.py")).body:
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if "__version__" in names:  # `__version__ = version = '0.5.23'`
                version = str(_literal(node.value))  # type: ignore[attr-defined]
    contract = parse_sampling(files.read(CONTRACT)) if files.has(CONTRACT) else None
    return SGLangAPI(
        version=version,
        location=str(location),
        routes=routes,
        structs=structs,
        default_auth=default_auth,
        open_prefixes=prefixes,
        sampling_fields=parse_sampling(files.read(SAMPLING)),
        contract_sampling=contract,
        files=files,
    )


@functools.cache
def sglang_api() -> SGLangAPI:
    """The API of the wheel `locate()` finds (parsed once per process)."""
    return load(locate())


# ---- the checker ---------------------------------------------------------------------------


@dataclass
class Captured:
    """One request as the recording proxy saw it."""

    method: str
    path: str
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    query: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    """What the released SGLang would refuse or silently drop: each names route and field."""
    notes: list[str] = field(default_factory=list)
    """Facts worth showing (the auth level the request meets)."""


def _list(names) -> str:
    return ", ".join(sorted(names))


def check_sampling(api: SGLangAPI, name: str, params: Any) -> list[str]:
    """Every key of one `sampling_params` object is a SamplingParams field (both structs)."""
    if isinstance(params, list):
        return [p for item in params for p in check_sampling(api, name, item)]
    if not isinstance(params, dict):
        return [f"{name}: sampling_params is a {type(params).__name__}, not an object"]
    out = []
    for key in params:
        if key not in api.sampling_fields:
            out.append(
                f"{name}: sampling_params key {key!r} is not a field of SamplingParams "
                f"({SAMPLING}; fields: {_list(api.sampling_fields)})"
            )
        elif api.contract_sampling is not None and key not in api.contract_sampling:
            out.append(
                f"{name}: sampling_params key {key!r} is not in the /generate contract's "
                f"SamplingParams ({CONTRACT}, unknown keys rejected; fields: "
                f"{_list(api.contract_sampling)})"
            )
    return out


def check_request(api: SGLangAPI, req: Captured) -> Verdict:
    """What SGLang `api.version` makes of one captured request: the route and method exist, every
    top-level body field is a field of the handler's struct, required fields are there, every
    `sampling_params` key is a SamplingParams field; the auth level it meets (a note)."""
    v = Verdict()
    route = api.routes.get(req.path)
    if route is None:
        v.problems.append(f"{req.name}: SGLang {api.version} has no route {req.path}")
        return v
    if req.method not in route.methods:
        v.problems.append(
            f"{req.name}: {req.path} answers {'/'.join(route.methods)}, not {req.method}"
        )
    for key in req.query:
        if key not in route.query:
            v.problems.append(
                f"{req.name}: query parameter {key!r} is not one of {route.handler}'s "
                f"({_list(route.query) or 'none'})"
            )
    body = req.body
    if route.struct is None:
        if body not in (None, {}, b"", ""):
            v.problems.append(
                f"{req.name}: {route.handler} reads no JSON body, yet one was sent: {body!r}"
            )
    elif route.struct not in api.structs:
        v.problems.append(f"{req.name}: struct {route.struct} is not in {IO_STRUCT}")
    else:
        struct = api.structs[route.struct]
        items = body if isinstance(body, list) else [body]
        for item in items:
            if item is None:
                item = {}
            if not isinstance(item, dict):
                v.problems.append(f"{req.name}: the body is a {type(item).__name__}, not an object")
                continue
            for key in item:
                if key not in struct.fields:
                    v.problems.append(
                        f"{req.name}: field {key!r} is not a field of {struct.name} "
                        f"(fields: {_list(struct.fields)})"
                    )
            for key in struct.required:
                if key not in item:
                    v.problems.append(
                        f"{req.name}: required field {key!r} of {struct.name} is missing"
                    )
            if "sampling_params" in item and "sampling_params" in struct.fields:
                v.problems += check_sampling(api, req.name, item["sampling_params"])
    level = api.auth_of(req.path)
    sent = "a bearer key" if "authorization" in {h.lower() for h in req.headers} else "no key"
    if api.open_path(req.path):
        v.notes.append(f"{req.name}: open to all (no key needed); sent {sent}")
    elif level == "ADMIN_FORCE":
        v.problems.append(f"{req.name}: ADMIN_FORCE needs admin_api_key; sent {sent}")
    elif level == "ADMIN_OPTIONAL":
        v.notes.append(
            f"{req.name}: ADMIN_OPTIONAL: only the admin key when the server has one, else the "
            f"api key; sent {sent}"
        )
    else:
        v.notes.append(f"{req.name}: {level}: the api key when the server has one; sent {sent}")
    return v


# ---- the docs' table -----------------------------------------------------------------------


def routes_table(api: SGLangAPI, used: list[tuple[str, str, str]]) -> str:
    """The markdown table of the routes the project sends, `used` = (method, path, sender),
    with the wheel's methods, auth level and struct (its required fields marked)."""
    rows = [
        "| Request | Sent by | SGLang methods | Auth level | Struct (required fields) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for method, path, sender in used:
        route = api.routes.get(path)
        if route is None:
            rows.append(f"| `{method} {path}` | {sender} | not in {api.version} | | |")
            continue
        level = "open (no key)" if api.open_path(path) else api.auth_of(path)
        struct = "none"
        if route.struct:
            req = api.structs[route.struct].required if route.struct in api.structs else []
            struct = f"`{route.struct}`" + (f" ({', '.join(req)})" if req else "")
        rows.append(
            f"| `{method} {path}` | {sender} | {'/'.join(route.methods)} | {level} | {struct} |"
        )
    return "\n".join(rows) + "\n"


def api_or_skip() -> SGLangAPI:
    """`sglang_api()`, or a pytest skip naming the download command that failed."""
    import pytest

    try:
        return sglang_api()
    except WheelUnavailable as e:
        pytest.skip(f"SGLang {VERSION}'s wheel is not available: {e}")
