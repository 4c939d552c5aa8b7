"""docs/models.md, the supported and refused model families, against the tests: each row's
config is built in the test file the row names (or in an example that file imports and runs),
every config the integration tests build has a row (the page lists what is tested, and nothing
tested is missing from it), and the README's list of models names exactly the page's exact
families (so it lists no family that no test covers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"
README = ROOT / "README.md"
TESTS = ROOT / "tests" / "integrations"
EXAMPLES = ROOT / "examples"
ROW = re.compile(r"^\| (?P<family>[^|]+?) \| `(?P<config>\w+)` \| [^|]+ \| `(?P<test>[\w.]+)` \|$")
BUILT = re.compile(r"\b(?:T|transformers)\.(\w+Config)\(")
IMPORTED = re.compile(r"^\s*import (\w+)", re.MULTILINE)


def _sections() -> dict[str, list[dict[str, str]]]:
    """The page's family rows under each ``## `` heading."""
    out: dict[str, list[dict[str, str]]] = {}
    heading = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif (m := ROW.match(line)) is not None:
            out.setdefault(heading, []).append(m.groupdict())
    assert out.get("Exact") and out.get("Refused"), f"{PAGE}: no Exact and Refused family rows"
    return out


def _rows() -> list[dict[str, str]]:
    return [row for rows in _sections().values() for row in rows]


def _built(test: Path) -> set[str]:
    """The transformers configs ``test`` builds, itself or through the examples it imports."""
    text = test.read_text()
    sources = [text] + [
        (EXAMPLES / f"{name}.py").read_text()
        for name in IMPORTED.findall(text)
        if (EXAMPLES / f"{name}.py").is_file()
    ]
    return {c for source in sources for c in BUILT.findall(source)}


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["family"])
def test_each_listed_family_is_built_in_the_test_it_names(row: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    assert hasattr(transformers, row["config"]), f"{row['family']}: no transformers.{row['config']}"
    test = TESTS / row["test"]
    assert test.is_file(), f"{row['family']}: {row['test']} is not in tests/integrations"
    built = _built(test)
    assert row["config"] in built, f"{row['family']}: {row['test']} builds no {row['config']}"


def test_every_family_the_tests_build_is_listed() -> None:
    listed = {r["config"] for r in _rows()}
    built = set().union(*(_built(path) for path in TESTS.glob("test_*.py")))
    assert built - listed == set(), f"tested but not in docs/models.md: {sorted(built - listed)}"


def test_the_readme_lists_exactly_the_exact_families() -> None:
    families = [r["family"] for r in _sections()["Exact"]]
    listed = ", ".join(families[:-1]) + " and " + families[-1]
    bullet = re.search(r"^- \*\*Models\*\*.*?(?=^- |^#)", README.read_text(), re.M | re.S)
    assert bullet is not None, f"{README}: no '- **Models**' bullet"
    text = " ".join(bullet.group(0).split())
    assert f"): {listed} — " in text, f"README's models are not the page's exact ones: {text!r}"
