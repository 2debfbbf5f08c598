"""The manual against the code: configuration.md's defaults, page lengths, links, history.

docs/configuration.md documents every key of the cluster file in tables of
`| key | type | unit | default | what it does |`, one table per section. These tests
parse them and compare each documented default with the config dataclasses' defaults
and with what `parse_config` gives for a missing key, and check that every field is
documented, so the reference cannot drift from `lookup_table/config.py`.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    ClusterConfig,
    ServiceConfig,
    SGDConfig,
    StoreConfig,
    TableSpec,
    parse_config,
)
from lookup_table.core.initializers import InitializerSpec
from lookup_table.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
MAX_PAGE_LINES = 400

# section heading (backticks dropped) -> the dataclass its table documents
SECTIONS: dict[str, type[Any]] = {
    "Top level": ClusterConfig,
    "adam": AdamConfig,
    "sgd": SGDConfig,
    "adagrad": AdagradConfig,
    "[[tables]]": TableSpec,
    "[store]": StoreConfig,
    "[service]": ServiceConfig,
}
# ClusterConfig fields that are sections of the file, each with a heading of its own
SECTION_FIELDS = {
    "optimizer": "[optimizer]",
    "tables": "[[tables]]",
    "store": "[store]",
    "service": "[service]",
}
# defaults computed from other keys, documented in words
COMPUTED = {(TableSpec, "seed"), (TableSpec, "optimizer")}
MINIMAL: dict[str, Any] = {"namespace": "ns", "memcached": ["127.0.0.1:11211"]}


@dataclasses.dataclass(frozen=True)
class Row:
    section: str
    key: str
    default: str


def _headings_and_rows(text: str) -> tuple[list[str], list[Row]]:
    headings: list[str] = []
    rows: list[Row] = []
    section = ""
    for line in text.splitlines():
        heading = re.match(r"#{2,3} (.+)", line)
        if heading:
            section = heading.group(1).replace("`", "").strip()
            headings.append(section)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            key = re.fullmatch(r"`([a-z_0-9]+)`", cells[0])
            assert key, f"configuration.md: a key cell must be one `key`, got {cells[0]!r}"
            rows.append(Row(section, key.group(1), cells[3]))
    return headings, rows


HEADINGS, ROWS = _headings_and_rows(CONFIGURATION.read_text(encoding="utf-8"))


def _fields(cls: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _literal(cell: str) -> Any:
    """The TOML value in the cell's first backticks."""
    match = re.match(r"`([^`]+)`", cell)
    assert match, cell
    return tomllib.loads(f"v = {match.group(1)}")["v"]


def _parsed(cls: type[Any], key: str) -> Any:
    """What `parse_config` makes of a minimal file without `key` in the section of
    `cls`: the attribute of the object of that section."""
    raw: dict[str, Any] = {**MINIMAL}
    if cls is ClusterConfig:
        raw.pop(key, None)
        return getattr(parse_config(raw, env={}), key)
    if cls in (AdamConfig, SGDConfig, AdagradConfig):
        raw["optimizer"] = {"name": cls().name}
        return getattr(parse_config(raw, env={}).optimizer, key)
    if cls is TableSpec:
        table: dict[str, Any] = {"name": "t", "dim": 1}
        table.pop(key, None)
        raw["tables"] = [table]
        return getattr(parse_config(raw, env={}).tables[0], key)
    name = {StoreConfig: "store", ServiceConfig: "service"}[cls]
    raw[name] = {}
    return getattr(getattr(parse_config(raw, env={}), name), key)


def test_every_section_is_documented() -> None:
    for heading in [*SECTIONS, *SECTION_FIELDS.values()]:
        assert heading in HEADINGS, f"configuration.md has no section {heading!r}"


@pytest.mark.parametrize("heading", list(SECTIONS))
def test_every_field_of_the_section_is_documented_once(heading: str) -> None:
    cls = SECTIONS[heading]
    documented = [r.key for r in ROWS if r.section == heading]
    assert len(documented) == len(set(documented)), f"{heading}: a key is listed twice"
    expected = set(_fields(cls))
    if cls in (AdamConfig, SGDConfig, AdagradConfig):
        expected -= {"name"}  # documented once, under [optimizer]
    if cls is ClusterConfig:
        expected -= set(SECTION_FIELDS)
    assert set(documented) == expected, (
        f"configuration.md, section {heading!r}: documents {sorted(documented)}, "
        f"{cls.__name__} has {sorted(expected)}"
    )


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r.section in SECTIONS], ids=lambda r: f"{r.section}.{r.key}"
)
def test_documented_default_is_the_codes(row: Row) -> None:
    cls = SECTIONS[row.section]
    default = _default(_fields(cls)[row.key])
    if row.default == "required":
        assert default is dataclasses.MISSING, f"{row.key} has a default: {default!r}"
        with pytest.raises(ConfigError, match=row.key):
            _parsed(cls, row.key)
        return
    if (cls, row.key) in COMPUTED:
        assert not row.default.startswith("`"), "a computed default is described in words"
        return
    if row.default == "none":
        assert default is None, f"{row.key}: documented none, the code has {default!r}"
        assert _parsed(cls, row.key) is None
        return
    literal = _literal(row.default)
    if isinstance(default, tuple):
        default = list(default)
    if cls is TableSpec and row.key == "initializer":
        literal = InitializerSpec.from_dict(literal)
    assert literal == default, f"{row.key}: documented {literal!r}, the dataclass has {default!r}"
    parsed = _parsed(cls, row.key)
    if isinstance(parsed, tuple):
        parsed = list(parsed)
    assert parsed == literal, f"{row.key}: documented {literal!r}, a missing key gives {parsed!r}"


def test_optimizer_name_default() -> None:
    (row,) = [r for r in ROWS if r.section == "[optimizer]"]
    assert row.key == "name"
    assert _literal(row.default) == ClusterConfig(namespace="n", memcached=()).optimizer.name


def test_the_complete_example_loads_and_shows_every_key() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    match = re.search(r"```toml\n(.*?)```", text, re.S)
    assert match, "configuration.md has no ```toml example"
    example = match.group(1)
    raw = tomllib.loads(example)
    config = parse_config(raw, env={})
    assert config.tables and config.optimizers
    shown = {
        ClusterConfig: set(raw),
        AdamConfig: set(raw["optimizer"]),
        TableSpec: {key for table in raw["tables"] for key in table},
        StoreConfig: set(raw["store"]),
        ServiceConfig: set(raw["service"]),
    }
    for cls, keys in shown.items():
        missing = set(_fields(cls)) - keys
        assert not missing, f"the example does not show {cls.__name__}'s {sorted(missing)}"


# ---------------------------------------------------------------- every page


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_page_is_at_most_400_lines(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_PAGE_LINES, f"{page.relative_to(ROOT)} has {lines} lines"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.+)", line)
        if match:
            slug = _slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_links_stay_in_the_repository_and_reach_their_target(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: {target}: no such heading"


# ---------------------------------------------------------------- code names

CODE_NAME = re.compile(
    r"\b(?:lookup_table|optimizer_service|trainer|benchmarks)(?:[./][A-Za-z_][A-Za-z_0-9]*)+/?"
)


FILE_SUFFIXES = {"md", "py", "json", "png", "toml", "sh", "txt", "yaml"}
PLACEHOLDERS = {"NAME", "FILE", "DIR"}


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names.update(ast.literal_eval(node.value or ast.List([])))  # lazy (PEP 562)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If):  # TYPE_CHECKING re-exports (lookup_table's lazy ones)
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    names.update(a.asname or a.name for a in inner.names)
    return names


def _stale_code_name(name: str) -> str | None:
    """Why `name` (a path like lookup_table/keras/ or a dotted lookup_table.keras.fit.X)
    names nothing in the tree, or None."""
    if "/" in name:
        path = ROOT / name.rstrip("/")
        return None if path.exists() or path.with_suffix(".py").exists() else "no such path"
    parts = name.rstrip(".").split(".")
    if parts[-1] in FILE_SUFFIXES or PLACEHOLDERS & set(parts):  # benchmarks.md, benchmarks.NAME
        return None
    for end in range(len(parts), 0, -1):
        module = _module_file(parts[:end])
        if module is None:
            continue
        rest = parts[end:]
        if (
            not rest
            or rest[0] in _top_level_names(module)
            or (ROOT.joinpath(*parts[:end]) / rest[0]).exists()
        ):
            return None
        return f"{'.'.join(parts[:end])} defines no {rest[0]}"
    return "no such module"


def test_stale_code_name_is_found() -> None:
    assert _stale_code_name("lookup_table/keras/") is None
    assert _stale_code_name("lookup_table.keras.export_saved_model") is None
    assert _stale_code_name("lookup_table.ops.checkpoint.save_checkpoint") is None
    assert _stale_code_name("lookup_table/remote.py") == "no such path"
    assert _stale_code_name("lookup_table.session.TrainingSession") is not None
    assert _stale_code_name("lookup_table.keras.checkpoint_rowz") is not None


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_module_path_and_name_in_the_manual_exists(page: Path) -> None:
    """Paths anywhere; dotted names in `code spans` and in import lines (a code example's
    `trainer.fit(...)` is a variable's method, not the package's)."""
    stale = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        spans = re.findall(r"`([^`]+)`", line)
        if re.match(r"\s*(from|import) ", line):
            spans.append(line)
        for match in CODE_NAME.finditer(line):
            name = match.group(0)
            if "/" not in name and not any(name in span for span in spans):
                continue
            if (why := _stale_code_name(name)) is not None:
                stale.append(f"{page.name}:{number}: {name}: {why}")
    assert stale == []


# ---------------------------------------------------------------- history

# Where history must not appear: the whole tree (it belongs in git's log).
HISTORY_SCOPE = (".",)
HISTORY = re.compile(
    r"\bsessions? \d|"  # numbered work periods
    + re.escape("DESIGN" + ".md")
    + "|"
    + re.escape("PERF-NOTES" + ".md")
    + "|"
    + re.escape("../" + "shared")
    + "|"
    + r"\bissues? #?\d",  # the tracker is not the user's
    re.I,
)


def _tracked(scope: tuple[str, ...]) -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *scope],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        names = []
    if not names:
        names = [
            str(p.relative_to(ROOT))
            for s in scope
            for p in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))
            if p.is_file()
        ]
    return [ROOT / n for n in names]


def test_no_development_history_in_the_manual() -> None:
    found = []
    for path in _tracked(HISTORY_SCOPE):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary, or deleted in the work tree
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "development history (leave it to git):\n" + "\n".join(found)
