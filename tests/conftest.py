import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # rank bodies must import by name in spawned ranks
sys.path.insert(1, str(Path(__file__).parent.parent))  # and examples/ as the README runs them (PYTHONPATH=.)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments():
    """Every test that maps /dev/shm must leave nothing there."""
    before = set(Path("/dev/shm").glob("ffnq-*"))
    yield
    left = set(Path("/dev/shm").glob("ffnq-*")) - before
    assert not left, f"leaked shared-memory segments: {sorted(p.name for p in left)}"
