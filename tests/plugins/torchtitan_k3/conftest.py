"""One seed checkpoint for every trainer test of this folder (each launch of TorchTitan's entry point costs tens of
seconds on 2 cores; 1-vs-2-rank comparisons need a common start: DTensor random init differs by world size)."""
from __future__ import annotations

import pytest

from k3_torchtitan.launch import create_seed


@pytest.fixture(scope="session")
def titan_root(tmp_path_factory):
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="session")
def seed(titan_root) -> list[str]:
    """Arguments starting a k3_tiny_cpu run from the shared seed checkpoint."""
    return create_seed(titan_root / "seed")
