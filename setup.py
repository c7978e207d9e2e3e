"""Package discovery only: `kernels/` is imported as `k3_kernels` (PyPI's `kernels` is another package);
`plugins/verl_k3/` as `k3_verl` (the verl plugin, loaded through the `verl.plugins` entry point);
`plugins/vllm_k3/` as `k3_vllm` (the vLLM plugin, `vllm.general_plugins`);
`plugins/torchtitan_k3/` as `k3_torchtitan` (the TorchTitan plugin, `--module k3_torchtitan`);
`plugins/sglang_k3/` as `k3_sglang` (the SGLang plugin, `sglang.srt.plugins` + `sglang.srt.platforms`)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["k3", "k3.*"])
    + ["k3_kernels"]
    + [f"k3_kernels.{p}" for p in find_packages("kernels")]
    + ["k3_verl", "k3_vllm", "k3_torchtitan", "k3_sglang"],
    package_dir={"k3_kernels": "kernels", "k3_verl": "plugins/verl_k3", "k3_vllm": "plugins/vllm_k3",
                 "k3_torchtitan": "plugins/torchtitan_k3", "k3_sglang": "plugins/sglang_k3"},
    package_data={"k3_kernels": ["norm/csrc/*.cpp"]},  # built on first use (torch.utils.cpp_extension)
)
