"""The packaged hardware catalogue: one YAML file per GPU, shipped in the wheel.

Only file access lives here; parsing and validation are in ``planner.hardware`` (the file format
is described there and in ``profiles/README.md``).
"""

from __future__ import annotations

from importlib import resources

SUFFIX = ".yaml"


def packaged_names() -> list[str]:
    """Catalogue keys of the packaged GPU files (file names without ``.yaml``), sorted."""
    root = resources.files(__name__)
    return sorted(p.name[: -len(SUFFIX)] for p in root.iterdir() if p.name.endswith(SUFFIX))


def read_packaged(name: str) -> str:
    """The text of the packaged file ``<name>.yaml``; FileNotFoundError when there is none."""
    return resources.files(__name__).joinpath(name + SUFFIX).read_text(encoding="utf-8")


def packaged_location(name: str) -> str:
    """Where the packaged file lives on disk, for messages that tell users what to copy."""
    return str(resources.files(__name__).joinpath(name + SUFFIX))
