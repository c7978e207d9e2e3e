"""`sft_step` in parts (`micro_batch`): what lets the benchmarks' K3-width target train every parameter within an
80 GB H100 (`spec_decode --sft-micro-batch`) must still be the whole step's update."""
import random

import pytest
import torch

from k3.config import K3Config
from k3.envs import CalculatorEnv, train_tasks
from k3.jobs.config import SFTSection
from k3.jobs.sft import sft_step
from k3.model import K3ForCausalLM


def test_sft_micro_batches_give_the_whole_batch_gradient():
    """A step forwarded in parts of `micro_batch` rows draws the same rows and leaves the gradient of the whole
    step's masked mean (each part weighted by its share of the masked tokens) and the same loss; uneven parts too;
    a micro batch below 1 is refused."""
    config = K3Config.preset("tiny")
    env, sft, tasks = CalculatorEnv(), SFTSection(), train_tasks(1, 64)

    def step(micro):
        torch.manual_seed(0)
        model = K3ForCausalLM(config)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.0)   # the step leaves the clipped gradients in place
        rng = random.Random(3)
        loss = sft_step(model, env, tasks, rng, sft, 5, params, opt, micro).item()
        return loss, [None if p.grad is None else p.grad.clone() for p in params], rng.random()

    whole_loss, whole, whole_rng = step(None)
    assert sum(g is not None for g in whole) > len(whole) // 2
    for micro in (2, 1):
        loss, grads, rng_after = step(micro)
        assert rng_after == whole_rng   # the same rows drawn
        assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss)
        assert [a is None for a in grads] == [b is None for b in whole]   # the same parameters reached
        for a, b in zip(grads, whole):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="micro_batch"):
        step(0)
