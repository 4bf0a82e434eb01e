"""docs/trainers/: one page per algorithm of `jaxrl.trainers.registry`, and the names a page
cites exist in the code: each field of its config table (with the default it states), each
`--flag`, and each metric key of its metrics table (a string the package builds)."""

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

from jaxrl.config_cli import PeftArguments
from jaxrl.trainers.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SECTIONS = (
    "What it does",
    "Dataset format",
    "Config fields that matter",
    "Metrics",
    "Example",
    "How it differs from TRL",
)
# Flags of `python -m jaxrl.train` itself, and DDPO's reward choice (`parse_ddpo_cli`).
CLI_FLAGS = {"algo", "config", "help"}
DDPO_FLAGS = {"reward"}


def _page(algo: str) -> str:
    return (DOCS / "trainers" / f"{algo}.md").read_text()


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _section(text: str, prefix: str) -> str:
    found = [body for title, body in _sections(text).items() if title.startswith(prefix)]
    assert len(found) == 1, f"expected one '## {prefix}...' section, found {len(found)}"
    return found[0]


def _table_rows(section: str) -> list[list[str]]:
    """Body rows of the section's markdown tables (header and separator rows left out)."""
    rows, header_seen = [], False
    for line in section.splitlines():
        if not line.startswith("|"):
            header_seen = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header_seen:
            header_seen = True
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        rows.append(cells)
    return rows


def _code(cell: str) -> str:
    m = re.match(r"`([^`]+)`", cell)
    assert m, f"expected a `name` at the start of table cell {cell!r}"
    return m.group(1)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_key_prefixer(node: ast.JoinedStr) -> bool:
    """`f"eval_{key}"`: prefixes any key, so it proves none is built."""
    first, *rest = node.values
    return (
        isinstance(first, ast.Constant)
        and first.value.endswith("_")
        and len(rest) == 1
        and isinstance(rest[0], ast.FormattedValue)
    )


@cache
def _produced() -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
    """Every string constant and class-body field name in the package, and each f-string as a
    pattern (`{...}` -> `.+`; f-strings that would match almost anything left out)."""
    constants, patterns = set(), []
    for path in (ROOT / "jaxrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
            elif isinstance(node, ast.ClassDef):  # NamedTuple metrics (DDPO's `approx_kl`)
                constants |= {
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
            elif isinstance(node, ast.JoinedStr):
                literal = [v.value for v in node.values if isinstance(v, ast.Constant)]
                if sum(len(s) for s in literal) < 3 or _is_key_prefixer(node):
                    continue
                regex = "".join(
                    re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values
                )
                patterns.append(re.compile(regex))
    return frozenset(constants), tuple(patterns)


def _is_produced(key: str) -> bool:
    constants, patterns = _produced()
    key = re.sub(r"<[^>]+>", "x", key)  # `rewards/<func>/mean`: one reward function's name
    candidates = [key] + ([key.removeprefix("eval_")] if key.startswith("eval_") else [])
    return any(c in constants or any(p.fullmatch(c) for p in patterns) for c in candidates)


def test_every_algorithm_has_a_page_linked_from_the_index():
    index = (DOCS / "index.md").read_text()
    for algo in ALGORITHMS:
        page = DOCS / "trainers" / f"{algo}.md"
        assert page.exists(), f"--algo {algo} has no page: write docs/trainers/{algo}.md"
        assert f"(trainers/{algo}.md)" in index, f"docs/index.md does not link trainers/{algo}.md"
        text = page.read_text()
        for prefix in SECTIONS:
            _section(text, prefix)
        assert f"python -m jaxrl.train --algo {algo}" in text
        assert ALGORITHMS[algo].config_class.__name__ in text
        assert ALGORITHMS[algo].trainer_class.__name__ in text


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_config_table_names_real_fields_with_their_defaults(algo):
    cls = ALGORITHMS[algo].config_class
    fields = _fields(cls)
    rows = _table_rows(_section(_page(algo), "Config fields that matter"))
    assert rows, "the config section has no table"
    for row in rows:
        name, default = _code(row[0]), _code(row[1])
        assert name in fields, f"{algo}.md lists `{name}`, not a field of {cls.__name__}"
        assert default == repr(_default(fields[name])), (
            f"{algo}.md says `{name}` defaults to {default}; the config class has "
            f"{_default(fields[name])!r}"
        )


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_flag_on_a_page_exists(algo):
    spec = ALGORITHMS[algo]
    known = set(_fields(spec.config_class)) | CLI_FLAGS | set(_fields(PeftArguments))
    known |= set(_fields(spec.script_class)) if spec.script_class else DDPO_FLAGS
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*)", _page(algo)))
    assert flags, "the page shows no command line"
    assert not flags - known, f"{algo}.md names flags that do not exist: {sorted(flags - known)}"


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_metric_key_on_a_page_is_built_by_the_package(algo):
    keys = set()
    for row in _table_rows(_section(_page(algo), "Metrics")):
        keys.add(_code(row[0]))
        # The other metrics a row names: `a/b` keys and `eval_...` / `train_...` ones.
        for cell in row[1:]:
            keys |= {
                k
                for k in re.findall(r"`([^`\s]+)`", cell)
                if "/" in k or re.fullmatch(r"(eval|train)_[a-z_/<>]+", k)
            }
    assert keys, "the metrics section has no table"
    missing = sorted(k for k in keys if not _is_produced(k))
    assert not missing, f"{algo}.md lists metric keys no jaxrl code builds: {missing}"


def test_key_check_can_fail():
    assert _is_produced("rewards/chosen")
    assert _is_produced("rewards/<func>/mean")
    assert _is_produced("eval_mean_token_accuracy")
    assert not _is_produced("rewards/chosen_typo")
    assert not _is_produced("eval_no_such_metric")
