"""k3_verl: the verl 0.9.1 plugin of k3-plugins.

verl imports this package through the `verl.plugins` entry point (pyproject.toml) at `import verl`, on the driver
and on every Ray worker. Importing it registers the policy loss `k3_gspo` (GSPO-token + our pi_theta/pi_old token
masking, `k3.rl.gspo_loss`) and adds k3 mismatch metrics (k3 KL, |Δ log p|, masked fraction) to the metrics verl's
trainer computes when rollout log-probs are present. Turn the loss on with
`actor_rollout_ref.actor.policy_loss.loss_mode=k3_gspo`. The logic lives in `k3.rl`; this package is glue.
"""
from .loss import compute_policy_loss_k3_gspo, mask_settings
from .metrics import install_mismatch_metrics, kl_metrics, mismatch_metrics_from_batch

install_mismatch_metrics()

__all__ = [
    "compute_policy_loss_k3_gspo",
    "install_mismatch_metrics",
    "kl_metrics",
    "mask_settings",
    "mismatch_metrics_from_batch",
]
