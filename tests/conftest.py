import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Keep CPU timings and thread pools small and repeatable on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def model_file(tmp_path):
    """Write a model file (dedented source) and return its path; examples/ is importable from it."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        header = f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\n"
        path.write_text(header + textwrap.dedent(source))
        return path

    return write


@pytest.fixture(scope="session", autouse=True)
def checkpoint_key(tmp_path_factory):
    """The checkpoint signing key of this test session (runtime.checkpoint.key_path): a fresh one,
    not the account's, inherited by every launched rank."""
    from runtime.checkpoint import KEY_ENV

    path = tmp_path_factory.mktemp("key") / "checkpoint.key"
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The tests' own cache directory (XDG_CACHE_HOME), inherited by every process they launch: the
    local CPU's figures and calibration that tests measure or refit (some under the suite's own load)
    never replace the account's. It starts as a copy of the account's parallel-planner cache, so a
    machine already measured is not measured again."""
    mine = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parallel-planner"
    root = tmp_path_factory.mktemp("cache")
    if mine.is_dir():
        shutil.copytree(mine, root / "parallel-planner")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root)
    yield root
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
