"""DDPO's clipped policy-gradient loss and its advantage bookkeeping (TRL v0.7.2 `DDPOTrainer`).

`ddpo_loss` is a pure function of per-sample log-probs of one denoising step (no model calls: the
current log-prob comes from `jaxrl.models.diffusion.ddim.transition_log_prob`). The advantage
helpers run on the host between sampling and training, on numpy arrays, as TRL's do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.core.shapes import same_shape


class DDPOLoss(NamedTuple):
    loss: jax.Array
    approx_kl: jax.Array
    clipfrac: jax.Array


def ddpo_loss(
    log_prob_B: jax.Array,
    old_log_prob_B: jax.Array,
    advantages_B: jax.Array,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
) -> DDPOLoss:
    """PPO-clip on one timestep's transition log-probs, TRL `calculate_loss`:

    adv = clip(adv, +-adv_clip_max); ratio = exp(logp - old_logp);
    loss = mean(max(-adv * ratio, -adv * clip(ratio, 1 - clip_range, 1 + clip_range)));
    approx_kl = mean((logp - old_logp)^2) / 2; clipfrac = mean(|ratio - 1| > clip_range).
    `train_clip_range` and `train_adv_clip_max` are the DDPOConfig names of the two knobs.
    """
    same_shape(
        "ddpo_loss",
        rank=1,
        log_prob_B=log_prob_B,
        old_log_prob_B=old_log_prob_B,
        advantages_B=advantages_B,
    )
    adv = jnp.clip(advantages_B, -adv_clip_max, adv_clip_max)
    delta = log_prob_B - old_log_prob_B
    ratio = jnp.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = jnp.mean(jnp.maximum(unclipped, clipped))
    approx_kl = 0.5 * jnp.mean(jnp.square(delta))
    clipfrac = jnp.mean((jnp.abs(ratio - 1.0) > clip_range).astype(jnp.float32))
    return DDPOLoss(loss, approx_kl, clipfrac)


def normalize_rewards(rewards: np.ndarray) -> np.ndarray:
    """Advantages without per-prompt tracking: (r - mean) / (std + 1e-8), population std (TRL)."""
    rewards = np.asarray(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


class PerPromptStatTracker:
    """Per-prompt reward normalisation (TRL `PerPromptStatTracker`, ddpo-pytorch `stat_tracking`).

    Each prompt keeps its last `buffer_size` rewards. A prompt's advantages are normalised by its
    buffer's mean and std once the buffer holds `min_count` rewards, by the whole batch's before.
    std is the population std plus 1e-6.
    """

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.stats: dict[str, deque] = {}

    def update(self, prompts: Sequence[str], rewards: np.ndarray) -> np.ndarray:
        prompts_arr = np.asarray(prompts)
        rewards = np.asarray(rewards)
        advantages = np.empty_like(rewards, dtype=np.result_type(rewards.dtype, np.float32))
        for prompt in np.unique(prompts_arr):
            rows = prompts_arr == prompt
            prompt_rewards = rewards[rows]
            buffer = self.stats.setdefault(str(prompt), deque(maxlen=self.buffer_size))
            buffer.extend(prompt_rewards)
            source = rewards if len(buffer) < self.min_count else np.asarray(buffer)
            advantages[rows] = (prompt_rewards - np.mean(source)) / (np.std(source) + 1e-6)
        return advantages

    def get_stats(self) -> dict[str, dict[str, float]]:
        return {
            k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "count": len(v)}
            for k, v in self.stats.items()
        }
