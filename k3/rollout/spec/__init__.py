"""Speculative decoding for the embedded engine: drafters (n-gram prompt lookup, a trained EAGLE3-style head),
chain verification, speculative rejection sampling and the ReplaySSM commit of KDA states (no per-draft state
snapshots: the verify pass stores each position's step inputs, the commit folds the accepted prefix)."""
from k3.rollout.spec.config import MAX_DRAFT_LEN, Acceptance, DrafterDtype, SpecConfig, SpecMethod, VerifyMode

__all__ = ["MAX_DRAFT_LEN", "Acceptance", "DrafterDtype", "SpecConfig", "SpecMethod", "VerifyMode"]
