"""k3: framework-neutral core of k3-plugins (config, reference model, rollout, RL, sync, LoRA)."""
__version__ = "0.1.0"
