"""k3_vllm: the vLLM 0.32 plugin of k3-plugins (placeholder while the model lands)."""


def register() -> None:
    """Entry point of `vllm.general_plugins`."""
