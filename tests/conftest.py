import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU; the variable must be set before triton is first imported
    # (its standard-library functions are decorated at import), i.e. before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
