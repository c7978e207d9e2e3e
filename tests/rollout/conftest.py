import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()

