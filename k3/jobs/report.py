"""Run outputs: JSONL metrics, a PNG with the reward curve, train-rollout KL and delta sizes, a summary table."""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Append-only JSONL, one object per update; every value must be finite (a NaN is a bug, not a metric)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict] = []
        path.write_text("")

    def write(self, row: dict) -> None:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"metrics: non-finite values for {bad} at update {row.get('update')}")
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def plot(rows: list[dict], path: Path, base_heldout: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    u = [r["update"] for r in rows]
    axes[0].plot(u, [r["reward"] for r in rows], label="train reward (rollouts)")
    ev = [(r["update"], r["heldout_reward"]) for r in rows if "heldout_reward" in r]
    if base_heldout is not None:
        ev = [(0, base_heldout), *ev]
    if ev:
        axes[0].plot(*zip(*ev), "o-", label="held-out reward (50 tasks)")
    axes[0].set_xlabel("update"); axes[0].set_ylabel("reward"); axes[0].set_ylim(0, 1); axes[0].legend()
    axes[1].semilogy(u, [max(r["kl_k3"], 1e-12) for r in rows])
    axes[1].set_xlabel("update"); axes[1].set_ylabel("k3 KL(rollout || trainer), per token")
    axes[2].plot(u, [r["delta_bytes"] / 1024 for r in rows], label="XOR delta (KiB)")
    axes[2].plot(u, [r["full_bytes"] / 1024 for r in rows], label="full snapshot (KiB)")
    axes[2].set_xlabel("update"); axes[2].set_ylabel("sync payload"); axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_table(summary: dict) -> str:
    lines = [f"{'metric':<34}{'value':>16}", "-" * 50]
    for k, v in summary.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        lines.append(f"{k:<34}{str(v):>16}")
    return "\n".join(lines)
