"""The trained drafter (EAGLE3-style head over the target's low/mid/high features): training lowers its loss
against the target's distributions, it round-trips through its cache directory, bad paths are named, and the
engine drafting with it stays bitwise plain decoding while accepting drafts on the rollouts it was trained on."""
import pytest
import torch

from k3.rollout import Engine, SamplingParams
from k3.rollout.spec import SpecConfig
from k3.rollout.spec.drafter import load_drafter, save_drafter
from k3.rollout.spec.train_drafter import DrafterTrainConfig, target_features, train_head

from _engine_helpers import SMALL, rand_tokens, same


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    prompts = [rand_tokens(10 + i, 80 + i) for i in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    ref = Engine(model, prefix_cache=False, **SMALL).generate(prompts, sp)
    seqs = [p + c.token_ids for p, c in zip(prompts, ref)]   # the target's own rollouts
    feats = target_features(model, seqs)
    tcfg = DrafterTrainConfig(steps=150, batch=64, lr=1e-2)
    head, figures = train_head(model, [(s, f, lp) for s, (f, lp) in zip(seqs, feats)], tcfg)
    path = tmp_path_factory.mktemp("drafter") / "drafter-test"
    save_drafter(head, path, {"figures": figures})
    return prompts, sp, ref, path, figures


def test_training_fits_the_targets_distributions(trained):
    *_, figures = trained
    assert figures["kl_last"] < 0.5 * figures["kl_first"], figures


def test_engine_with_the_drafter_is_bitwise_plain_decoding(model, trained):
    prompts, sp, ref, path, _ = trained
    eng = Engine(model, prefix_cache=True, speculative=SpecConfig(method="drafter", drafter_path=str(path)), **SMALL)
    eng.check_each_step = True
    assert same(eng.generate(prompts, sp), ref)
    st = eng.stats
    assert st["spec_accepted_tokens"] > 0.3 * st["spec_draft_tokens"], st


def test_drafter_path_errors_are_named(model, tmp_path):
    with pytest.raises(ValueError, match="drafter_path"):
        Engine(model, speculative=SpecConfig(method="drafter"))
    with pytest.raises(ValueError, match="drafter_path: no trained drafter"):
        load_drafter(tmp_path, model)
    with pytest.raises(ValueError, match="drafter.steps"):
        DrafterTrainConfig(steps=0).validate()
