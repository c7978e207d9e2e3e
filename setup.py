"""Package discovery only: `kernels/` is imported as `k3_kernels` (PyPI's `kernels` is another package)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["k3", "k3.*"])
    + ["k3_kernels"]
    + [f"k3_kernels.{p}" for p in find_packages("kernels")],
    package_dir={"k3_kernels": "kernels"},
)
