import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM


def _make_tiny(seed: int = 0, res_std: float = 0.5, router_bias: bool = False) -> K3ForCausalLM:
    """The tiny preset with non-trivial AttnRes projections (and router bias) drawn from N(0, res_std), so that tests
    exercise them (their initial values are zeros)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight") or (router_bias and n.endswith("e_score_correction_bias")):
                p.normal_(0, res_std)
    return model


@pytest.fixture(scope="session")
def make_tiny():
    """Factory for the tiny test model (see `_make_tiny`)."""
    return _make_tiny
