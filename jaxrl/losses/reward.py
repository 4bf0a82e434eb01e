"""Bradley-Terry reward-model loss and metrics (TRL `RewardTrainer.compute_loss` semantics).

Pure functions of `[B]` scalar rewards; no model calls. The loss is returned per example so a
trainer can average it over any number of micro-batches.
"""

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_shape


def reward_loss(
    rewards_chosen_B: jax.Array,
    rewards_rejected_B: jax.Array,
    *,
    margin_B: jax.Array | None = None,
    center_rewards_coefficient: float | None = None,
) -> jax.Array:
    """Per-example `-log sigmoid(r_c - r_r - margin) + coef * (r_c + r_r)^2`.

    TRL computes `-logsigmoid(r_c - r_r - margin).mean() + coef * mean((r_c + r_r)^2)`
    (margin: Llama 2 paper, Eq. 2; centering: Eisenstein et al. 2023); both terms are batch
    means, so the mean of this per-example loss is TRL's loss exactly.
    """
    same_shape(
        "reward_loss",
        rank=1,
        rewards_chosen_B=rewards_chosen_B,
        rewards_rejected_B=rewards_rejected_B,
        margin_B=margin_B,
    )
    diff_B = rewards_chosen_B - rewards_rejected_B
    if margin_B is not None:
        diff_B = diff_B - margin_B
    losses_B = -jax.nn.log_sigmoid(diff_B)
    if center_rewards_coefficient is not None:
        losses_B = losses_B + center_rewards_coefficient * jnp.square(
            rewards_chosen_B + rewards_rejected_B
        )
    return losses_B


def reward_metrics(
    rewards_chosen_B: jax.Array, rewards_rejected_B: jax.Array
) -> dict[str, jax.Array]:
    """TRL `RewardTrainer` metrics for one batch.

    `min_reward` / `mean_reward` / `max_reward` are over chosen and rejected rewards together;
    `accuracy` is the fraction of pairs with `r_c > r_r` (ties count as wrong); `margin` is the
    mean of `r_c - r_r`.
    """
    same_shape(
        "reward_metrics",
        rank=1,
        rewards_chosen_B=rewards_chosen_B,
        rewards_rejected_B=rewards_rejected_B,
    )
    all_rewards = jnp.concatenate([rewards_chosen_B, rewards_rejected_B]).astype(jnp.float32)
    diff_B = (rewards_chosen_B - rewards_rejected_B).astype(jnp.float32)
    return {
        "min_reward": jnp.min(all_rewards),
        "mean_reward": jnp.mean(all_rewards),
        "max_reward": jnp.max(all_rewards),
        "accuracy": jnp.mean((diff_B > 0).astype(jnp.float32)),
        "margin": jnp.mean(diff_B),
    }
