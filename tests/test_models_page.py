"""docs/models.md, the supported and refused model families, against the tests: each row's
config is built in the test file the row names, and every config the integration tests build
has a row (the page lists what is tested, and nothing tested is missing from it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"
TESTS = ROOT / "tests" / "integrations"
ROW = re.compile(r"^\| (?P<family>[^|]+?) \| `(?P<config>\w+)` \| [^|]+ \| `(?P<test>[\w.]+)` \|$")
BUILT = re.compile(r"\b(?:T|transformers)\.(\w+Config)\(")


def _rows() -> list[dict[str, str]]:
    rows = [m.groupdict() for m in map(ROW.match, PAGE.read_text().splitlines()) if m]
    assert rows, f"{PAGE}: no family rows"
    return rows


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["family"])
def test_each_listed_family_is_built_in_the_test_it_names(row: dict[str, str]) -> None:
    transformers = pytest.importorskip("transformers")
    assert hasattr(transformers, row["config"]), f"{row['family']}: no transformers.{row['config']}"
    test = TESTS / row["test"]
    assert test.is_file(), f"{row['family']}: {row['test']} is not in tests/integrations"
    assert row["config"] in BUILT.findall(test.read_text()), (
        f"{row['family']}: {row['test']} builds no {row['config']}"
    )


def test_every_family_the_tests_build_is_listed() -> None:
    listed = {r["config"] for r in _rows()}
    built = {c for path in TESTS.glob("test_*.py") for c in BUILT.findall(path.read_text())}
    assert built - listed == set(), f"tested but not in docs/models.md: {sorted(built - listed)}"
