"""Trainer.Config functions for `--module k3_torchtitan --config <name>` (TorchTitan's config manager imports this
module and calls the named function; CLI flags then override fields, e.g. --parallelism.data_parallel_shard_degree).

k3_tiny / k3_small / k3: GPU training settings (bf16 parameters under FSDP, selective activation checkpointing).
*_cpu: the same models on CPU with gloo (cpu.use_cpu() plus fp32, no CUDA graphs, contiguous CP shards, the local
byte tokenizer and arithmetic dataset): what CI runs. *_gspo*: K3GSPOTrainer with GSPOLoss on RL batch files."""
from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.trainer import Trainer

from . import model_registry
from .cpu import use_cpu
from .data import ArithmeticDataLoader, ByteTokenizer
from .loss import GSPOLoss
from .rl_data import RLBatchDataLoader
from .rl_trainer import K3GSPOTrainer


def _trainer(flavor: str, *, seq_len: int, batch: int, steps: int, lr: float, rl: bool = False) -> Trainer.Config:
    spec = model_registry(flavor)
    if rl:  # GSPO steps on RL batch files through the stock loop (rl_trainer.py)
        config_cls, loss, data = K3GSPOTrainer.Config, GSPOLoss.Config(), RLBatchDataLoader.Config()
    else:
        config_cls = Trainer.Config
        loss = CrossEntropyLoss.Config(global_vocab_size=spec.model.k3.vocab_size)
        data = ArithmeticDataLoader.Config()
    return config_cls(
        model_spec=spec,
        loss=loss,
        tokenizer=ByteTokenizer.Config(),
        dataloader=data,
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None),
        # CUDA graphs off: the MoE groups tokens by expert on the host (k3.model's expert loop), which capture forbids
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(interval=steps, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def k3_tiny() -> Trainer.Config:
    return _trainer("k3_tiny", seq_len=256, batch=8, steps=100, lr=3e-3)


def k3_small() -> Trainer.Config:
    return _trainer("k3_small", seq_len=2048, batch=4, steps=1000, lr=1e-3)


def k3() -> Trainer.Config:
    return _trainer("k3", seq_len=8192, batch=1, steps=1000, lr=2e-4)


def cpu_trainer_settings(config: Trainer.Config) -> Trainer.Config:
    """The CPU/gloo set-up (see cpu.py): rebinds TorchTitan's device globals, then fp32 everywhere, no CUDA graphs,
    foreach AdamW (the fused one is CUDA-only), no activation checkpointing unless asked for."""
    use_cpu()
    config.training.mixed_precision_param = "float32"
    config.training.dtype = "float32"
    config.training.disable_cuda_graphs = True
    config.optimizer.implementation = "foreach"
    config.activation_checkpoint = None
    config.comm.init_timeout_seconds = 120
    config.comm.train_timeout_seconds = 120
    config.debug.seed = 0
    config.debug.deterministic = True
    if isinstance(config.dataloader, ArithmeticDataLoader.Config):
        config.dataloader.corpus_lines = 512
    return config


def k3_tiny_cpu() -> Trainer.Config:
    config = cpu_trainer_settings(_trainer("k3_tiny", seq_len=32, batch=2, steps=5, lr=3e-3))
    return config


def k3_tiny_gspo() -> Trainer.Config:
    """GSPO (k3.rl) steps through TorchTitan's loop (K3GSPOTrainer) on an RL batch file: --dataloader.path."""
    return _trainer("k3_tiny", seq_len=256, batch=8, steps=100, lr=1e-4, rl=True)


def k3_tiny_gspo_cpu() -> Trainer.Config:
    """k3_tiny_gspo on CPU (gloo, fp32): --dataloader.path FILE, --dataloader.no-router-replay turns R3 off."""
    config = cpu_trainer_settings(_trainer("k3_tiny", seq_len=32, batch=2, steps=2, lr=3e-3, rl=True))
    # PPO-width bands: the tests' rollouts are off-policy by ~0.05 nats a token, which GSPO's 3e-4 / 4e-4 would clip
    # to a zero gradient
    config.loss.eps_low, config.loss.eps_high = 0.2, 0.28
    return config


def k3_tiny_r3_cpu() -> Trainer.Config:
    """k3_tiny_cpu whose batches carry a recorded routing (Router Replay through the trainer)."""
    config = k3_tiny_cpu()
    k3cfg = config.model_spec.model.k3
    config.dataloader.routing_layers = len(k3cfg.moe_layer_ids)
    config.dataloader.routing_top_k = k3cfg.num_experts_per_token
    config.dataloader.routing_experts = k3cfg.num_experts
    return config


def k3_tiny_lora_cpu() -> Trainer.Config:
    """k3_tiny_cpu training a rank-8 k3.lora adapter on the attention and expert projections (base frozen)."""
    from k3.lora import LoRAConfig

    config = k3_tiny_cpu()
    config.model_spec.model.lora = LoRAConfig.preset("tiny")
    return config


def k3_tiny_full_ac_cpu() -> Trainer.Config:
    """k3_tiny_cpu with full activation checkpointing of every decoder layer."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = k3_tiny_cpu()
    config.activation_checkpoint = FullAC.Config()
    return config


def k3_tiny_selective_ac_cpu() -> Trainer.Config:
    """k3_tiny_cpu with TorchTitan's selective (per-op) activation checkpointing of every decoder layer."""
    config = k3_tiny_cpu()
    config.activation_checkpoint = SelectiveAC.Config()
    return config
