import os

# The interpreter's tl.dot is numpy's matmul, i.e. OpenBLAS, whose sgemm kernel is picked per CPU at load time; the
# Zen/Haswell kernels sum a column differently depending on the matrix width, which the bitwise tests (state-pass V
# block) would read as a kernel bug. One AVX kernel everywhere keeps interpreter results the same on every x86 CI
# machine (this one exports OPENBLAS_CORETYPE=Haswell, so it is overridden, not defaulted); it must be chosen before
# numpy is first loaded (torch loads it).
os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU; the variable must be set before triton is first imported
    # (its standard-library functions are decorated at import), i.e. before any test module is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread, as `k3` itself uses on CPU (k3.cli): the tiny model's many small ops gain nothing from
    # a thread pool, and on a busy 2-core machine OpenMP's spinning threads made the engine tests ~25x slower.
    torch.set_num_threads(int(os.environ.get("K3_CPU_THREADS", "1")))


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
