"""Pure loss functions (no model calls): DPO family, reward model, SFT, GRPO family, RLOO."""

from jaxrl.losses.dpo import (
    LOSS_TYPES,
    RunningMoments,
    dpo_loss,
    dpo_multi_loss,
    running_moments_init,
    running_moments_update,
)
from jaxrl.losses.grpo import grpo_advantages, grpo_loss
from jaxrl.losses.reward import reward_loss, reward_metrics
from jaxrl.losses.rloo import rloo_advantages, rloo_loss
from jaxrl.losses.sft import entropy, mean_of, mean_token_accuracy, sft_loss_sum

__all__ = [
    "LOSS_TYPES",
    "RunningMoments",
    "dpo_loss",
    "dpo_multi_loss",
    "entropy",
    "grpo_advantages",
    "grpo_loss",
    "mean_of",
    "mean_token_accuracy",
    "reward_loss",
    "reward_metrics",
    "rloo_advantages",
    "rloo_loss",
    "running_moments_init",
    "running_moments_update",
    "sft_loss_sum",
]
