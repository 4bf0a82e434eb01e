"""RLOO: leave-one-out advantages with a KL-shaped reward, and its sequence-level clipped loss.

Pure `jnp` functions following TRL 1.16 `RLOOTrainer` (`_generate_and_score_completions` for
the reward shaping and advantages, `_compute_loss` for the loss). Unlike GRPO, RLOO puts the
KL penalty into the reward (first-order estimator `log pi_old - log pi_ref` summed over the
sequence, Ahmadian et al. 2024) and uses one importance ratio per *sequence* (summed, not
averaged, token log-ratios).

Gradient accumulation contract: `rloo_loss` returns `loss_sum = sum_b w_b * loss_b` with count
`sum_b w_b` (sequences); the generic step divides once, which is TRL's per-sequence mean over
the optimizer step's batch (TRL: mean per micro-batch, averaged over accumulation steps; equal
for equal micro-batch sizes).
"""

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_shape, shape_is
from jaxrl.losses.grpo import nan_max, nan_min, nanstd, weighted_rewards, zero_std

_STD_EPS = 1e-4


def rloo_sequence_kl(
    old_per_token_logps_BT: jax.Array, ref_per_token_logps_BT: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """`(kl_B, aux)`: per-sequence k1 KL `sum_t (log pi_old - log pi_ref) mask` for the reward,
    and TRL's `kl` metric (token mean over the batch) as a `{"sum", "count"}` reduction."""
    same_shape(
        "rloo_sequence_kl",
        rank=2,
        old_per_token_logps_BT=old_per_token_logps_BT,
        ref_per_token_logps_BT=ref_per_token_logps_BT,
        mask_BT=mask_BT,
    )
    mask_BT = mask_BT.astype(jnp.float32)
    per_token_kl_BT = (old_per_token_logps_BT - ref_per_token_logps_BT).astype(jnp.float32)
    kl_B = jnp.sum(per_token_kl_BT * mask_BT, axis=-1)
    aux = {"sum": {"kl": jnp.sum(kl_B)}, "count": {"kl": jnp.sum(mask_BT)}}
    return kl_B, aux


def rloo_advantages(
    rewards_per_func_NK: jax.Array,
    reward_weights_K: jax.Array,
    *,
    num_generations: int,
    beta: float = 0.05,
    kl_N: jax.Array | None = None,
    reward_clip_range: tuple[float, float] | None = None,
    normalize_advantages: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Leave-one-out advantages of the whole generation batch (TRL `RLOOTrainer`).

    The reward is the weighted NaN-sum of the reward functions, clipped to `reward_clip_range`,
    minus `beta * kl_N` (`rloo_sequence_kl`). Each completion's baseline is the mean reward of
    its scorable siblings; with `normalize_advantages` the advantages are z-scored over the
    batch. Unscorable completions (and groups with one scorable completion) get advantage 0.

    Returns:
      `(advantages_N, is_std_zero_P)`: the per-group zero-std flags whose mean TRL logs as
      `frac_reward_zero_std`.
    """
    rewards_per_func_NK = jnp.asarray(rewards_per_func_NK, jnp.float32)
    shape_is("rloo_advantages", (None, None), rewards_per_func_NK=rewards_per_func_NK)
    N, K = rewards_per_func_NK.shape
    shape_is("rloo_advantages", (K,), reward_weights_K=reward_weights_K)
    shape_is("rloo_advantages", (N,), kl_N=kl_N)
    G = num_generations
    if N % G:
        raise ValueError(f"{N} completions do not split into groups of num_generations={G}.")
    rewards_N = weighted_rewards(rewards_per_func_NK, reward_weights_K)
    if reward_clip_range:
        rewards_N = jnp.clip(rewards_N, reward_clip_range[0], reward_clip_range[1])
    if beta != 0.0:
        if kl_N is None:
            raise ValueError(f"beta={beta} needs kl_N, the per-sequence KL from rloo_sequence_kl.")
        rewards_N = rewards_N - beta * kl_N
    grouped_PG = rewards_N.reshape(-1, G)
    std_P = nanstd(grouped_PG, axis=1) if G > 1 else jnp.zeros(N // G)
    if G > 1:
        scorable_P1 = jnp.sum(~jnp.isnan(grouped_PG), axis=1, keepdims=True)
        sum_P1 = jnp.nansum(grouped_PG, axis=1, keepdims=True)
        # 0/0 = NaN for a lone scorable completion: zeroed below, as TRL does.
        baselines_N = ((sum_P1 - grouped_PG) / (scorable_P1 - 1)).reshape(-1)
        advantages_N = rewards_N - baselines_N
    else:
        advantages_N = jnp.zeros_like(rewards_N)
    if normalize_advantages:
        advantages_N = (advantages_N - jnp.nanmean(advantages_N)) / (
            nanstd(advantages_N) + _STD_EPS
        )
    return jnp.nan_to_num(advantages_N, nan=0.0), zero_std(std_P)


def rloo_loss(
    per_token_logps_BT: jax.Array,
    advantages_B: jax.Array,
    mask_BT: jax.Array,
    *,
    old_logps_B: jax.Array | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    entropies_BT: jax.Array | None = None,
    example_mask_B: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """`(loss_sum, aux)` of one micro-batch: PPO-clipped surrogate on sequence log-prob ratios.

    `ratio_b = exp(sum_t logp - old_logps_b)` (`old_logps_B` is the summed sampling-policy
    log-prob; None means on-policy), `loss_b = -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)`.
    `aux` carries `loss` and TRL's `clip_ratio/low_mean|high_mean|region_mean` (sequence means),
    `clip_ratio/low_min`, `clip_ratio/high_max` (NaN when every row is padding, as TRL's
    `nanmin`/`nanmax`) and `entropy` (token mean, if `entropies_BT`).
    """
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    same_shape(
        "rloo_loss",
        rank=2,
        per_token_logps_BT=per_token_logps_BT,
        mask_BT=mask_BT,
        entropies_BT=entropies_BT,
    )
    shape_is(
        "rloo_loss",
        per_token_logps_BT.shape[:1],
        advantages_B=advantages_B,
        old_logps_B=old_logps_B,
        example_mask_B=example_mask_B,
    )
    dtype = per_token_logps_BT.dtype
    mask_BT = mask_BT.astype(dtype)
    w_B = (
        jnp.ones(mask_BT.shape[0], dtype)
        if example_mask_B is None
        else example_mask_B.astype(dtype)
    )
    logps_B = jnp.sum(per_token_logps_BT * mask_BT, axis=-1)
    old_B = jax.lax.stop_gradient(logps_B) if old_logps_B is None else old_logps_B
    adv_B = jnp.asarray(advantages_B, dtype)
    coef_1 = jnp.exp(logps_B - old_B)
    coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
    loss_B = -jnp.minimum(coef_1 * adv_B, coef_2 * adv_B)
    loss_sum = jnp.sum(loss_B * w_B)
    n = jnp.sum(w_B)

    coef_1 = jax.lax.stop_gradient(coef_1)
    low_B = ((coef_1 < 1 - eps_low) & (adv_B < 0)).astype(jnp.float32)
    high_B = ((coef_1 > 1 + eps_high) & (adv_B > 0)).astype(jnp.float32)
    valid_B = w_B > 0
    sums = {
        "loss": jax.lax.stop_gradient(loss_sum),
        "clip_ratio/low_mean": jnp.sum(low_B * w_B),
        "clip_ratio/high_mean": jnp.sum(high_B * w_B),
        "clip_ratio/region_mean": jnp.sum(jnp.maximum(low_B, high_B) * w_B),
    }
    counts = {k: n for k in sums}
    if entropies_BT is not None:
        token_mask_BT = mask_BT * w_B[:, None]
        sums["entropy"] = jnp.sum(jax.lax.stop_gradient(entropies_BT) * token_mask_BT)
        counts["entropy"] = jnp.sum(token_mask_BT)
    aux = {
        "sum": sums,
        "count": counts,
        "min": {"clip_ratio/low_min": nan_min(low_B, valid_B)},
        "max": {"clip_ratio/high_max": nan_max(high_B, valid_B)},
    }
    return loss_sum, aux
