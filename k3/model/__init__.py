"""Reference Kimi K3 in plain PyTorch."""
from k3.model.model import K3ForCausalLM, K3Output, count_parameters
from k3.model.state import CacheView, DenseCache, K3State, KDACache, MLACache

__all__ = ["CacheView", "DenseCache", "K3ForCausalLM", "K3Output", "K3State", "KDACache", "MLACache", "count_parameters"]
