"""The test suite never writes the account's cache (tests/conftest.py private_cache)."""

import os
from pathlib import Path

from planner.local_device import cache_path, calibration_path


def test_the_suite_caches_in_its_own_directory(private_cache):
    account = Path.home() / ".cache" / "parallel-planner"
    assert os.environ["XDG_CACHE_HOME"] == str(private_cache)
    for path in (cache_path(), calibration_path()):
        assert path.parent == private_cache / "parallel-planner" != account
