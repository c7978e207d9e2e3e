import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests skip (with a reason) where there is no CUDA; their CPU counterparts always run."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (CPU counterpart runs in interpreter/reference mode)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
