"""What cpshard's package metadata declares it needs: ``cpshard env`` prints it, and a hook that
does not match the installed transformers names the range cpshard is tested with."""

from __future__ import annotations

import re
from importlib import metadata


def declared_requirements() -> list[str]:
    """cpshard's declared requirements, extras included (none from a source checkout on the
    path, which has no package metadata)."""
    try:
        return list(metadata.requires("cpshard") or ())
    except metadata.PackageNotFoundError:
        return []


def declared_range(distribution: str) -> str:
    """The release range declared for ``distribution`` (e.g. ``transformers>=5.24.0``), or a
    phrase saying it is declared when the metadata is not there to read."""
    for spec in declared_requirements():
        requirement = spec.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]*", requirement).group(0)
        if _normal(name) == _normal(distribution):
            return requirement
    return f"the {distribution} range cpshard declares"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
