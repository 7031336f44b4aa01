"""The docs hold together: links resolve, the config reference is current, no history markers.

Checks every relative link and image of the README, the CHANGELOG, `docs/` and the rooms'
READMEs against the tree (anchors against the target's headings, as GitHub makes them), the
generated `docs/configuration.md` against `render()`, and that no issue or session number leaks
into the code or the docs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from slime_async.config.reference import COMMAND, DOC_PATH, render


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


ROOT = _repo_root()
README_MAX_LINES = 350

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HISTORY = re.compile(r"\b(issues?[\s-]+#?\d+|sessions?[\s-]+\d+)", re.IGNORECASE)
HISTORY_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".json", ".yaml", ".yml"}


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "examples").rglob("README.md"))
    files += sorted((ROOT / "slime_async").rglob("README.md"))
    return [f for f in files if f.is_file()]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, CODE_SPAN.sub("", line)


def links(text: str) -> Iterator[tuple[int, str]]:
    for n, line in prose_lines(text):
        for m in INLINE_LINK.finditer(line):
            yield n, m.group(1)
        m = REFERENCE_DEF.match(line)
        if m:
            yield n, m.group(1)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markup dropped, lower case, punctuation removed."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for n, target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto: ...: not a file of this tree
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{where} (no heading with anchor #{fragment} in {dest.name})")
    return bad


def test_every_relative_link_resolves():
    files = doc_files()
    assert ROOT / "README.md" in files and any(f.parent.name == "docs" for f in files)
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Two words `code`\n")
    page.write_text(
        "[ok](other.md#two-words-code) [gone](missing.md) [bad anchor](other.md#nope)\n"
        "```\n[in a fence](ignored.md)\n```\n`[in code](ignored.md)` ![img](missing.png)\n"
    )
    bad = broken_links(page, root=tmp_path)
    assert [b.split(": ", 1)[1].split(" ")[0] for b in bad] == [
        "missing.md",
        "other.md#nope",
        "missing.png",
    ]


SOURCE_SPAN = re.compile(r"`([\w./-]+\.py)(?::[\w.]+)?`")
EXTERNAL_SOURCES = ("python/sglang/", "srt/", "managers/", "utils/weight_versions.py", "my_")
"""Code spans that name another project's files (SGLang's source) or the user's own."""


def stale_source_paths(path: Path, sources: list[str], root: Path = ROOT) -> list[str]:
    """`file.py` code spans that no file of the checkout ends with (a moved or deleted module or
    test): each is written relative to some folder, so a suffix match is the check."""
    bad = []
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        for m in [] if fenced else SOURCE_SPAN.finditer(line):
            name = m.group(1).removeprefix("./")
            if name.startswith(EXTERNAL_SOURCES):
                continue
            if not any(s == name or s.endswith("/" + name) for s in sources):
                bad.append(f"{path.relative_to(root)}:{n}: {name}")
    return bad


def test_source_files_named_in_the_docs_exist():
    """Dated history (docs/benchmarks/, CHANGELOG.md) may name files as they were then."""
    sources = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    files = [f for f in doc_files() if "benchmarks" not in f.parts and f.name != "CHANGELOG.md"]
    files.append(ROOT / "tests" / "README.md")
    bad = [b for f in files for b in stale_source_paths(f, sources)]
    assert not bad, "docs name source files that do not exist:\n" + "\n".join(bad)


def test_the_source_path_check_sees_a_moved_file(tmp_path):
    sources = ["slime_async/queue/state.py", "tests/unit/queue/test_queue_wal.py"]
    page = tmp_path / "page.md"
    page.write_text(
        "`queue/state.py` `tests/test_queue_wal.py` `srt/managers/io_struct.py`\n"
        "```\n`gone.py`\n```\n"
    )
    bad = stale_source_paths(page, sources, root=tmp_path)
    assert [b.split(": ", 1)[1] for b in bad] == ["tests/test_queue_wal.py"]


def test_slugs_follow_github():
    assert slug("`[run.ray]`") == "runray"
    assert slug("Fixed lag (`buffer.fixed_lag = k`)") == "fixed-lag-bufferfixed_lag--k"
    assert slug("A rollout plug-in") == "a-rollout-plug-in"


def test_configuration_reference_is_current():
    assert DOC_PATH == ROOT / "docs" / "configuration.md"
    assert DOC_PATH.read_text() == render(), f"docs/configuration.md is stale: run `{COMMAND}`"


def history_files() -> Iterator[Path]:
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md"))
    for folder in ("slime_async", "docs", "examples", "configs", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.is_file()
                and path.suffix in HISTORY_SUFFIXES
                and "__pycache__" not in path.parts
                and path != Path(__file__).resolve()  # this file spells the forms out to test them
            ):
                yield path


def test_no_issue_or_session_numbers_in_code_or_docs():
    hits = []
    for path in history_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, (
        "development history in code or docs (say the fact, not the issue or session):\n"
        + "\n".join(hits)
    )


def test_history_pattern_catches_the_forms():
    for text in ("see issue 12", "Issues #16", "(issue-18's engine)", "last Session 5"):
        assert HISTORY.search(text), text
    for text in ("one live session per id", "a tissue 3", "sessions.py"):
        assert not HISTORY.search(text), text


def test_readme_is_a_guide_not_a_notebook():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
