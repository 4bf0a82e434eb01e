"""The PPO clipped policy + clipped value loss of one minibatch, TRL v0.7.2 `PPOTrainer.loss`.

Pure function of per-token arrays (no model call). Statistics use TRL's flattened names
(`loss/policy`, `policy/approxkl`, `val/clipfrac`, ...); `policy/advantages` and `policy/ratio`
are the full `[B, T]` arrays (TRL logs them flattened, not averaged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.core.rl import clip_by_value, masked_mean, masked_var
from jaxrl.core.shapes import same_shape

PPO_SCALAR_STATS = (
    "loss/policy",
    "loss/value",
    "loss/total",
    "policy/entropy",
    "policy/approxkl",
    "policy/policykl",
    "policy/clipfrac",
    "policy/advantages_mean",
    "returns/mean",
    "returns/var",
    "val/vpred",
    "val/error",
    "val/clipfrac",
    "val/mean",
    "val/var",
)
PPO_ARRAY_STATS = ("policy/advantages", "policy/ratio")


def ppo_loss(
    old_logprobs_BT: jax.Array,
    values_BT: jax.Array,
    logprobs_BT: jax.Array,
    vpreds_BT: jax.Array,
    mask_BT: jax.Array,
    advantages_BT: jax.Array,
    returns_BT: jax.Array,
    entropy_BT: jax.Array,
    *,
    cliprange: float = 0.2,
    cliprange_value: float = 0.2,
    vf_coef: float = 0.1,
    ratio_threshold: float = 10.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss, stats)` with `loss = pg_loss + vf_coef * vf_loss` (masked means over the minibatch).

    Value loss: `0.5 * mean(max((v - R)^2, (clip(v, v_old +- cliprange_value) - R)^2))`.
    Policy loss: `mean(max(-A r, -A clip(r, 1 +- cliprange)))`, `r = exp(logp - logp_old)`.
    When the masked mean ratio exceeds `ratio_threshold` the losses (and their stats) are
    multiplied by 0: the minibatch is skipped but the optimizer still steps, as in TRL.
    `entropy_BT` is the per-token entropy of the current policy (statistics only). Besides
    TRL's keys, `stats["ratio_skipped"]` is 1.0 when the minibatch was skipped (TRL warns).
    """
    same_shape(
        "ppo_loss",
        rank=2,
        old_logprobs_BT=old_logprobs_BT,
        values_BT=values_BT,
        logprobs_BT=logprobs_BT,
        vpreds_BT=vpreds_BT,
        mask_BT=mask_BT,
        advantages_BT=advantages_BT,
        returns_BT=returns_BT,
        entropy_BT=entropy_BT,
    )
    f32 = jnp.float32
    mask_BT = mask_BT.astype(f32)
    old_logprobs_BT, values_BT = old_logprobs_BT.astype(f32), values_BT.astype(f32)
    logprobs_BT, vpreds_BT = logprobs_BT.astype(f32), vpreds_BT.astype(f32)

    vpredclipped_BT = clip_by_value(
        vpreds_BT, values_BT - cliprange_value, values_BT + cliprange_value
    )
    vf_losses1_BT = jnp.square(vpreds_BT - returns_BT)
    vf_losses2_BT = jnp.square(vpredclipped_BT - returns_BT)
    vf_loss = 0.5 * masked_mean(jnp.maximum(vf_losses1_BT, vf_losses2_BT), mask_BT)
    vf_clipfrac = masked_mean((vf_losses2_BT > vf_losses1_BT).astype(f32), mask_BT)

    ratio_BT = jnp.exp(logprobs_BT - old_logprobs_BT)
    pg_losses_BT = -advantages_BT * ratio_BT
    pg_losses2_BT = -advantages_BT * jnp.clip(ratio_BT, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(jnp.maximum(pg_losses_BT, pg_losses2_BT), mask_BT)
    pg_clipfrac = masked_mean((pg_losses2_BT > pg_losses_BT).astype(f32), mask_BT)

    loss = pg_loss + vf_coef * vf_loss
    avg_ratio = jax.lax.stop_gradient(masked_mean(ratio_BT, mask_BT))
    keep = jnp.where(avg_ratio > ratio_threshold, 0.0, 1.0)
    pg_loss, vf_loss, loss = pg_loss * keep, vf_loss * keep, loss * keep

    sg = jax.lax.stop_gradient
    logratio_BT = sg(logprobs_BT - old_logprobs_BT)
    stats = {
        "loss/policy": sg(pg_loss),
        "loss/value": sg(vf_loss),
        "loss/total": sg(loss),
        "policy/entropy": masked_mean(sg(entropy_BT).astype(f32), mask_BT),
        "policy/approxkl": 0.5 * masked_mean(jnp.square(logratio_BT), mask_BT),
        "policy/policykl": masked_mean(-logratio_BT, mask_BT),
        "policy/clipfrac": sg(pg_clipfrac),
        "policy/advantages": sg(advantages_BT),
        "policy/advantages_mean": masked_mean(sg(advantages_BT), mask_BT),
        "policy/ratio": sg(ratio_BT),
        "returns/mean": masked_mean(sg(returns_BT), mask_BT),
        "returns/var": masked_var(sg(returns_BT), mask_BT),
        "val/vpred": masked_mean(sg(vpreds_BT), mask_BT),
        "val/error": masked_mean(sg(vf_losses1_BT), mask_BT),
        "val/clipfrac": sg(vf_clipfrac),
        "val/mean": masked_mean(values_BT, mask_BT),
        "val/var": masked_var(values_BT, mask_BT),
        "ratio_skipped": 1.0 - keep,
    }
    return loss, stats
