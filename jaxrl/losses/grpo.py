"""GRPO-family policy losses and group-relative advantages (TRL 1.16 `GRPOTrainer` semantics).

Pure `jnp` functions, jit-able, no model calls. Formulas follow `trl/trainer/grpo_trainer.py`
(TRL 1.16): advantages from `_generate_and_score_completions`, the loss from `_compute_loss`.

Gradient accumulation contract. The generic step (`jaxrl/core/step.py`) sums the unnormalised
`loss_sum` and `aux["count"]["loss"]` over the micro-batches of one optimizer step and divides
once. `grpo_aggregate` maps each `loss_type` onto such a pair, per micro-batch (`l` the per-token
loss, `m` the loss mask, `w` the example mask):

  grpo, sapo : sum_b w_b * sum_t l m / max(sum_t m, 1)       count sum_b w_b   (sequences)
  luspo      : sum_b w_b * sum_t l m                          count sum_b w_b
  dr_grpo    : sum_bt l m / max_completion_length             count sum_b w_b
  dapo, cispo, vespo : sum_bt l m                             count sum_bt m    (active tokens)
  bnpo       : sum_bt l m / max(sum_bt m, 1)                  count 1           (micro-batches)

Every type but `bnpo` therefore gives the loss and gradient of the whole optimizer-step batch
whatever the split. TRL's `bnpo` is defined on the *local* batch (each micro-batch's token mean,
then averaged over accumulation steps); its pair reproduces exactly that, so it depends on the
split as TRL documents. TRL's `dapo`/`cispo`/`vespo` divide by the *generation batch's* active
tokens x `gradient_accumulation_steps / steps_per_generation`: pass `token_count` (the
generation batch's active tokens / `steps_per_generation`) as each micro-batch's count to get
exactly that; with the default `steps_per_generation == gradient_accumulation_steps` it equals
the step's own active-token count, the default count.

Entropy bonus (TRL's `entropy_coef` / `use_adaptive_entropy`). TRL subtracts `coef * H` from
each micro-batch's loss, `H` the micro-batch's mean entropy over the tokens the loss acts on
(`completion_mask`, times the top-entropy mask), divided by `gradient_accumulation_steps`
whatever the loss type. `grpo_loss(entropy_coef=...)` subtracts `coef * H * count` from the
micro-batch's `loss_sum`: the step divides by the summed counts, `A x count` when every
micro-batch has the same count (in `GRPOTrainer`: its rows for the sequence-normalised types,
the generation batch's tokens / `steps_per_generation` for `dapo`/`cispo`/`vespo`, 1 for
`bnpo`), which leaves `coef x sum_i H_i / A`, TRL's bonus. `adaptive_entropy_coef` and
`entropy_bonus_coef` are TRL's controller; the entropies get their gradient through the LM head
from `jaxrl.core.logprobs.token_logprobs(..., entropy_grad=True)`.
"""

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_shape, shape_in, shape_is

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Loss types whose per-token loss is the (two-sided) clipped surrogate; they log clip ratios.
_CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_STD_EPS = 1e-4  # TRL adds it to the reward std before dividing


def resolve_scale_rewards(scale_rewards: str | bool) -> str:
    """TRL's `scale_rewards` with its aliases resolved: True -> "group", False -> "none"."""
    value = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if value not in SCALE_REWARDS:
        raise ValueError(
            f"Invalid scale_rewards {scale_rewards!r}; use one of {list(SCALE_REWARDS)} "
            "(or True for 'group', False for 'none')."
        )
    return value


def nanstd(x: jax.Array, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """Bessel-corrected std ignoring NaNs; NaN where fewer than two values (TRL `nanstd`)."""
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    var = jnp.nanmean(jnp.square(x - mean), axis=axis, keepdims=True)
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
    var = var * jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
    std = jnp.sqrt(var)
    return std if keepdims else jnp.squeeze(std, axis=axis)


def weighted_rewards(rewards_per_func_NK: jax.Array, reward_weights_K: jax.Array) -> jax.Array:
    """`[N]` weighted NaN-sum over reward functions; NaN where every function returned None."""
    rewards_per_func_NK = jnp.asarray(rewards_per_func_NK, jnp.float32)
    rewards_N = jnp.nansum(rewards_per_func_NK * jnp.asarray(reward_weights_K)[None, :], axis=1)
    unscorable_N = jnp.all(jnp.isnan(rewards_per_func_NK), axis=1)
    return jnp.where(unscorable_N, jnp.nan, rewards_N)


def nan_min(x_B: jax.Array, valid_B: jax.Array) -> jax.Array:
    """Min of `x_B` over the `valid_B` entries; NaN when there are none (TRL `nanmin`)."""
    return jnp.where(jnp.any(valid_B), jnp.min(jnp.where(valid_B, x_B, jnp.inf)), jnp.nan)


def nan_max(x_B: jax.Array, valid_B: jax.Array) -> jax.Array:
    """Max of `x_B` over the `valid_B` entries; NaN when there are none (TRL `nanmax`)."""
    return jnp.where(jnp.any(valid_B), jnp.max(jnp.where(valid_B, x_B, -jnp.inf)), jnp.nan)


def zero_std(std: jax.Array) -> jax.Array:
    """Flags a zero reward std, as TRL's `torch.isclose(std, 0)` (atol 1e-8; NaN is not zero)."""
    return jnp.abs(std) <= 1e-8


def grpo_advantages(
    rewards_per_func_NK: jax.Array,
    reward_weights_K: jax.Array,
    *,
    num_generations: int,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> tuple[jax.Array, jax.Array]:
    """Group-relative advantages of the whole generation batch (TRL `GRPOTrainer`).

    Args:
      rewards_per_func_NK: `[N, K]` reward of each completion under each reward function, NaN
        where a function returned None. Rows come in groups of `num_generations` consecutive
        completions of the same prompt.
      reward_weights_K: `[K]` `GRPOConfig.reward_weights` (ones by default).

    Returns:
      `(advantages_N, is_std_zero_N)`. Advantages of unscorable rows (all functions None) are 0;
      `is_std_zero_N` is the flag whose mean TRL logs as `frac_reward_zero_std`.
    """
    scale_rewards = resolve_scale_rewards(scale_rewards)
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"Invalid multi_objective_aggregation {multi_objective_aggregation!r}; use one of "
            f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}."
        )
    rewards_per_func_NK = jnp.asarray(rewards_per_func_NK, jnp.float32)
    shape_is("grpo_advantages", (None, None), rewards_per_func_NK=rewards_per_func_NK)
    N, K = rewards_per_func_NK.shape
    shape_is("grpo_advantages", (K,), reward_weights_K=reward_weights_K)
    G = num_generations
    if N % G:
        raise ValueError(f"{N} completions do not split into groups of num_generations={G}.")
    weights_K = jnp.asarray(reward_weights_K, jnp.float32)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards_N = weighted_rewards(rewards_per_func_NK, weights_K)
        grouped_PG = rewards_N.reshape(-1, G)
        mean_N = jnp.repeat(jnp.nanmean(grouped_PG, axis=1), G)
        if scale_rewards == "batch":
            std_N = jnp.broadcast_to(nanstd(rewards_N) if N > 1 else 0.0, (N,))
        else:  # "group", and "none" (whose std only feeds frac_reward_zero_std)
            std_N = jnp.repeat(nanstd(grouped_PG, axis=1), G) if G > 1 else jnp.zeros(N)
        advantages_N = rewards_N - mean_N
        if scale_rewards != "none":
            advantages_N = advantages_N / (std_N + _STD_EPS)
    else:  # normalize_then_sum: z-score each function within its group, then a batch z-score
        grouped_PGK = rewards_per_func_NK.reshape(-1, G, K)
        mean_P1K = jnp.nanmean(grouped_PGK, axis=1, keepdims=True)
        std_P1K = nanstd(grouped_PGK, axis=1, keepdims=True) if G > 1 else jnp.zeros_like(mean_P1K)
        z_NK = ((grouped_PGK - mean_P1K) / (std_P1K + _STD_EPS)).reshape(N, K)
        rewards_N = jnp.nansum(z_NK * weights_K[None, :], axis=1)
        rewards_N = jnp.where(jnp.all(jnp.isnan(rewards_per_func_NK), axis=1), jnp.nan, rewards_N)
        std_N = jnp.broadcast_to(nanstd(rewards_N) if N > 1 else 0.0, (N,))
        advantages_N = (rewards_N - jnp.nanmean(rewards_N)) / (std_N + _STD_EPS)
    return jnp.nan_to_num(advantages_N, nan=0.0), zero_std(std_N)


def truncated_completions(
    completion_ids_BT: jax.Array,
    completion_mask_BT: jax.Array,
    eos_token_ids: tuple[int, ...] | list[int],
    pad_token_id: int,
) -> jax.Array:
    """`[B]` bool: the completion's last token is neither EOS nor padding (it hit the length cap).

    With `mask_truncated_completions=True` TRL multiplies the loss mask by `~truncated[:, None]`,
    so a truncated completion still counts as a sequence but contributes no token.
    """
    same_shape(
        "truncated_completions",
        rank=2,
        completion_ids_BT=completion_ids_BT,
        completion_mask_BT=completion_mask_BT,
    )
    length_B = jnp.sum(completion_mask_BT > 0, axis=-1)
    rows_B = jnp.arange(completion_ids_BT.shape[0])
    last_B = completion_ids_BT[rows_B, jnp.maximum(length_B - 1, 0)]
    stop_ids = jnp.asarray([*eos_token_ids, pad_token_id])
    return (length_B > 0) & ~jnp.any(last_B[:, None] == stop_ids[None, :], axis=-1)


def high_entropy_mask(entropies_BT: jax.Array, mask_BT: jax.Array, quantile: float) -> jax.Array:
    """Tokens at or above the `1 - quantile` entropy quantile of the masked tokens.

    TRL's `top_entropy_quantile` (Wang et al. 2025, "Beyond the 80/20 rule"): the threshold is the
    linear-interpolated quantile of the entropies of all active tokens passed in (TRL: of one
    micro-batch gathered over processes). Returns a `[B, T]` float mask, zero on padding.
    """
    same_shape("high_entropy_mask", entropies_BT=entropies_BT, mask_BT=mask_BT)
    active_BT = mask_BT > 0
    values = jnp.where(active_BT, entropies_BT.astype(jnp.float32), jnp.nan)
    threshold = jnp.nanquantile(values, 1.0 - quantile)
    keep_BT = (entropies_BT * mask_BT >= threshold) & active_BT
    # No active token at all: TRL returns an all-false mask.
    return jnp.where(jnp.any(active_BT), keep_BT, False).astype(jnp.float32)


def off_policy_mask(
    advantages_B1: jax.Array,
    per_token_logps_BT: jax.Array,
    sampling_per_token_logps_BT: jax.Array,
    mask_BT: jax.Array,
    threshold: float,
) -> jax.Array:
    """`[B, 1]` keep-mask of DeepSeek-V3.2 off-policy sequence masking (`off_policy_mask_threshold`).

    Drops sequences with a negative advantage whose mean per-token forward KL
    `log pi_old - log pi_theta` exceeds `threshold`; NaN sampling log-probs count as zero KL.
    """
    kl_BT = jnp.nan_to_num(sampling_per_token_logps_BT - jax.lax.stop_gradient(per_token_logps_BT))
    seq_kl_B1 = jnp.sum(kl_BT * mask_BT, axis=1, keepdims=True) / jnp.maximum(
        jnp.sum(mask_BT, axis=1, keepdims=True), 1.0
    )
    return ((advantages_B1 >= 0) | (seq_kl_B1 <= threshold)).astype(mask_BT.dtype)


def vespo_gamma_weights(
    advantages_B1: jax.Array,
    log_ratio_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> jax.Array:
    """`[B, 1]` VESPO weight `phi(w) = exp(lambda) w^k exp(-lambda w)` of the sequence ratio `w`.

    `w` is the product of token ratios (sum of clamped log-ratios, clamped to [log 1e-8, 20]),
    `k`/`lambda` picked by the sign of the advantage. Under `stop_gradient`: phi only scales the
    policy gradient (VESPO, TRL `get_gamma_weights`).
    """
    lower = jnp.log(1e-8)
    log_ratio_BT = jnp.clip(jax.lax.stop_gradient(log_ratio_BT), -20.0, 20.0)
    log_w_B1 = jnp.clip(jnp.sum(log_ratio_BT * mask_BT, axis=-1, keepdims=True), lower, 20.0)
    nonneg_B1 = advantages_B1 >= 0
    k_B1 = jnp.where(nonneg_B1, k_pos, k_neg)
    lam_B1 = jnp.maximum(jnp.where(nonneg_B1, lambda_pos, lambda_neg), 1e-4)
    phi_B1 = jnp.exp(lam_B1 + k_B1 * log_w_B1 - lam_B1 * jnp.exp(log_w_B1))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi_B1, nan=0.0, posinf=0.0, neginf=0.0))


def entropy_bonus_coef(
    entropy_coef: jax.Array | float, last_entropy: jax.Array | float, entropy_target: float
) -> jax.Array:
    """The coefficient adaptive entropy control applies during an optimizer step (TRL 1.16):
    the coefficient left by the previous step, 0 unless that step's entropy was at most
    `entropy_target` (TRL starts from an entropy of +inf, so the first step applies none)."""
    return jnp.where(last_entropy <= entropy_target, entropy_coef, 0.0)


def adaptive_entropy_coef(
    entropy_coef: jax.Array | float,
    window_entropy: jax.Array | float,
    *,
    entropy_target: float,
    entropy_coef_delta: float,
    entropy_coef_min: float,
    entropy_coef_max: float,
) -> jax.Array:
    """TRL 1.16's adaptive entropy controller (Skywork-OR1), once per optimizer step: up by
    `entropy_coef_delta` (at most `entropy_coef_max`) when the step's token-weighted entropy is
    at most `entropy_target`, else down by it (at least `entropy_coef_min`)."""
    return jnp.where(
        window_entropy <= entropy_target,
        jnp.minimum(entropy_coef + entropy_coef_delta, entropy_coef_max),
        jnp.maximum(entropy_coef - entropy_coef_delta, entropy_coef_min),
    )


def _validate(loss_type: str, importance_sampling_level: str, beta: float, ref) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"Unknown GRPO loss_type {loss_type!r}; valid loss types are {list(LOSS_TYPES)}."
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"Unknown importance_sampling_level {importance_sampling_level!r}; use one of "
            f"{list(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    if beta != 0.0 and ref is None:
        raise ValueError(f"beta={beta} needs ref_per_token_logps_BT (reference model log-probs).")


def grpo_per_token_loss(
    per_token_logps_BT: jax.Array,
    advantages: jax.Array,
    mask_BT: jax.Array,
    *,
    old_per_token_logps_BT: jax.Array | None = None,
    ref_per_token_logps_BT: jax.Array | None = None,
    sampling_per_token_logps_BT: jax.Array | None = None,
    entropy_mask_BT: jax.Array | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    sapo_temperature_neg: float = 1.05,
    sapo_temperature_pos: float = 1.0,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = True,
    off_policy_mask_threshold: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token GRPO-family loss before aggregation (TRL `GRPOTrainer._compute_loss`).

    Args:
      per_token_logps_BT: `[B, T]` completion-token log-probs of the policy (differentiated).
      advantages: `[B]` (or `[B, T]`) advantages.
      mask_BT: `[B, T]` loss mask (completion mask, zero rows for masked truncated completions).
      old_per_token_logps_BT: sampling-policy log-probs; None means on-policy
        (`stop_gradient(per_token_logps_BT)`, TRL's `num_iterations == 1` shortcut).
      ref_per_token_logps_BT: reference log-probs, required when `beta != 0`.
      sampling_per_token_logps_BT: log-probs the sampler reported, for off-policy masking
        (defaults to the old log-probs, as TRL without vLLM).
      entropy_mask_BT: optional `high_entropy_mask` (`top_entropy_quantile < 1`).
      epsilon, epsilon_high: clip range `[1 - epsilon, 1 + epsilon_high]` (`epsilon_high`
        defaults to `epsilon`); for `cispo`, `epsilon_high` is the ratio cap itself.
      delta: INTELLECT-2 two-sided clipping: the unclipped ratio is capped at `delta`.

    Returns:
      `(per_token_loss_BT, parts)`: the loss to aggregate with `grpo_aggregate`, and the
      intermediates `grpo_metrics` reads: `coef_1` (`[B, T]` or `[B, 1]` importance weight after
      the `delta` cap), optional `per_token_kl` `[B, T]` (k3, times the ratio when
      `use_bias_correction_kl`), optional `phi_seq` `[B, 1]` (vespo).
    """
    _validate(loss_type, importance_sampling_level, beta, ref_per_token_logps_BT)
    same_shape(
        "grpo_per_token_loss",
        rank=2,
        per_token_logps_BT=per_token_logps_BT,
        mask_BT=mask_BT,
        old_per_token_logps_BT=old_per_token_logps_BT,
        ref_per_token_logps_BT=ref_per_token_logps_BT,
        sampling_per_token_logps_BT=sampling_per_token_logps_BT,
        entropy_mask_BT=entropy_mask_BT,
    )
    B, T = per_token_logps_BT.shape
    shape_in("grpo_per_token_loss", [(B,), (B, 1), (B, T)], advantages=advantages)
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask_BT = mask_BT.astype(per_token_logps_BT.dtype)
    adv = jnp.asarray(advantages, per_token_logps_BT.dtype)
    adv = adv[:, None] if adv.ndim == 1 else adv
    old_BT = (
        jax.lax.stop_gradient(per_token_logps_BT)
        if old_per_token_logps_BT is None
        else old_per_token_logps_BT
    )
    log_ratio_BT = per_token_logps_BT - old_BT
    if importance_sampling_level == "token":
        log_w = log_ratio_BT
    else:  # GSPO: length-normalised sequence log-ratio, one weight per sequence
        log_w = jnp.sum(log_ratio_BT * mask_BT, axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(mask_BT, axis=-1, keepdims=True), 1.0
        )
    coef_1 = jnp.exp(log_w)
    parts: dict[str, jax.Array] = {}

    if beta != 0.0:
        # k3 estimator of KL(pi || pi_ref) (Schulman 2020), unbiased-gradient form of DeepSeek-V3.2.
        d_BT = ref_per_token_logps_BT - per_token_logps_BT
        per_token_kl_BT = jnp.exp(d_BT) - d_BT - 1
        if use_bias_correction_kl:
            per_token_kl_BT = per_token_kl_BT * coef_1
        parts["per_token_kl"] = per_token_kl_BT

    if loss_type == "cispo":
        # MiniMax-M1: REINFORCE on log-probs weighted by the capped, non-differentiated ratio.
        capped = jax.lax.stop_gradient(jnp.minimum(coef_1, eps_high))
        loss = -capped * adv * per_token_logps_BT
    elif loss_type in _CLIPPED_LOSS_TYPES:
        coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = jnp.minimum(coef_1, delta)
        loss = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        # SAPO: a sigmoid gate around ratio 1 instead of a hard clip (temperature by advantage sign).
        tau = jnp.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -(jax.nn.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    else:  # vespo
        phi_B1 = vespo_gamma_weights(
            adv,
            log_ratio_BT,
            mask_BT,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        loss = -phi_B1 * adv * per_token_logps_BT
        parts["phi_seq"] = phi_B1
    parts["coef_1"] = coef_1

    if off_policy_mask_threshold is not None:
        sampling_BT = old_BT if sampling_per_token_logps_BT is None else sampling_per_token_logps_BT
        loss = loss * off_policy_mask(
            adv, per_token_logps_BT, sampling_BT, mask_BT, off_policy_mask_threshold
        )
    if entropy_mask_BT is not None:
        loss = loss * entropy_mask_BT
    if beta != 0.0:
        loss = loss + beta * parts["per_token_kl"]
    return jnp.broadcast_to(loss, per_token_logps_BT.shape), parts


def grpo_aggregate(
    per_token_loss_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    example_mask_B: jax.Array | None = None,
    token_count: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(loss_sum, count)` of one micro-batch for `loss_type` (see the module docstring).

    `example_mask_B` zeroes padding rows added to fill a static batch shape; their loss mask
    must be zero too. `dr_grpo` needs `max_completion_length`. `token_count` replaces the
    micro-batch's own active-token count as the `dapo`/`cispo`/`vespo` count (TRL's
    generation-batch normaliser, see the module docstring).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"Unknown GRPO loss_type {loss_type!r}; valid loss types are {list(LOSS_TYPES)}."
        )
    same_shape("grpo_aggregate", rank=2, per_token_loss_BT=per_token_loss_BT, mask_BT=mask_BT)
    shape_is("grpo_aggregate", per_token_loss_BT.shape[:1], example_mask_B=example_mask_B)
    mask_BT = mask_BT.astype(per_token_loss_BT.dtype)
    w_B = (
        jnp.ones(per_token_loss_BT.shape[0], per_token_loss_BT.dtype)
        if example_mask_B is None
        else example_mask_B.astype(per_token_loss_BT.dtype)
    )
    seq_sum_B = jnp.sum(per_token_loss_BT * mask_BT, axis=-1) * w_B
    count = grpo_count(
        mask_BT, loss_type=loss_type, example_mask_B=example_mask_B, token_count=token_count
    )
    if loss_type in ("grpo", "sapo"):
        return jnp.sum(seq_sum_B / jnp.maximum(jnp.sum(mask_BT, axis=-1), 1.0)), count
    if loss_type == "luspo":
        return jnp.sum(seq_sum_B), count
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' normalises by max_completion_length; pass it.")
        return jnp.sum(seq_sum_B) / max_completion_length, count
    if loss_type == "bnpo":
        num_tokens = jnp.sum(mask_BT * w_B[:, None])
        return jnp.sum(seq_sum_B) / jnp.maximum(num_tokens, 1.0), count
    return jnp.sum(seq_sum_B), count  # dapo, cispo, vespo


def grpo_count(
    mask_BT: jax.Array,
    *,
    loss_type: str,
    example_mask_B: jax.Array | None = None,
    token_count: jax.Array | float | None = None,
) -> jax.Array:
    """The loss-unit count `grpo_aggregate` gives one micro-batch (the module docstring's
    table): its sequences, its active tokens (or `token_count`), or 1 for `bnpo`. Trainers sum
    it over a step's micro-batches to weight per-micro-batch mean terms (`UNITS_PER_MICRO`)."""
    mask_BT = mask_BT.astype(jnp.float32)
    w_B = (
        jnp.ones(mask_BT.shape[0], jnp.float32)
        if example_mask_B is None
        else example_mask_B.astype(jnp.float32)
    )
    if loss_type in ("grpo", "sapo", "luspo", "dr_grpo"):
        return jnp.sum(w_B)
    if loss_type == "bnpo":
        return jnp.ones((), jnp.float32)
    if token_count is not None:
        return jnp.asarray(token_count, jnp.float32)
    return jnp.sum(mask_BT * w_B[:, None])  # dapo, cispo, vespo


def grpo_metrics(
    parts: dict[str, jax.Array],
    advantages: jax.Array,
    mask_BT: jax.Array,
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    entropies_BT: jax.Array | None = None,
    example_mask_B: jax.Array | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """TRL's `_compute_loss` metrics as `{"sum", "count", "min", "max"}` reductions (step format).

    Names: `kl` (beta != 0), `entropy` (if `entropies_BT`), `clip_ratio/low_mean`,
    `clip_ratio/high_mean`, `clip_ratio/region_mean`, `clip_ratio/low_min`,
    `clip_ratio/high_max` (clipped loss types), `cispo_clip_ratio`, `vespo/phi_seq_mean`.
    Token-level quantities average over active tokens, sequence-level ones over sequences;
    `low_min`/`high_max` reduce the per-sequence clip fractions (sequences with no active token
    are ignored, as TRL's NaN-aware min/max; NaN when no sequence has one, as TRL's `nanmin` of
    all-NaN). Over several micro-batches the step reduces these over the whole optimizer step
    (token-weighted means, min/max ignoring NaN micro-batches), where TRL logs the average of
    per-micro-batch values; they agree for a single micro-batch.
    """
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    same_shape("grpo_metrics", rank=2, mask_BT=mask_BT, entropies_BT=entropies_BT)
    B, T = mask_BT.shape
    shape_in("grpo_metrics", [(B,), (B, 1), (B, T)], advantages=advantages)
    shape_is("grpo_metrics", (B,), example_mask_B=example_mask_B)
    dtype = jnp.float32
    mask_BT = mask_BT.astype(dtype)
    w_B = (
        jnp.ones(mask_BT.shape[0], dtype)
        if example_mask_B is None
        else example_mask_B.astype(dtype)
    )
    mask_BT = mask_BT * w_B[:, None]
    adv = jnp.asarray(advantages, dtype)
    adv = adv[:, None] if adv.ndim == 1 else adv
    sums: dict[str, jax.Array] = {}
    counts: dict[str, jax.Array] = {}
    mins: dict[str, jax.Array] = {}
    maxs: dict[str, jax.Array] = {}

    def add_mean(name: str, x: jax.Array) -> None:
        x = jax.lax.stop_gradient(x).astype(dtype)
        if x.shape[-1] == 1:  # one value per sequence
            sums[name], counts[name] = jnp.sum(x[:, 0] * w_B), jnp.sum(w_B)
        else:
            sums[name], counts[name] = jnp.sum(x * mask_BT), jnp.sum(mask_BT)

    def per_seq(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if x.shape[-1] == 1:
            return x[:, 0], w_B > 0
        n_B = jnp.sum(mask_BT, axis=-1)
        return jnp.sum(x * mask_BT, axis=-1) / jnp.maximum(n_B, 1.0), n_B > 0

    if "per_token_kl" in parts:
        add_mean("kl", parts["per_token_kl"])
    if entropies_BT is not None:
        add_mean("entropy", entropies_BT)
    coef_1 = jax.lax.stop_gradient(parts["coef_1"])
    if loss_type in _CLIPPED_LOSS_TYPES:
        low = ((coef_1 < 1 - eps_low) & (adv < 0)).astype(dtype)
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).astype(dtype)
        add_mean("clip_ratio/low_mean", low)
        add_mean("clip_ratio/high_mean", high)
        add_mean("clip_ratio/region_mean", jnp.maximum(low, high))
        low_B, valid_B = per_seq(low)
        high_B, _ = per_seq(high)
        mins["clip_ratio/low_min"] = nan_min(low_B, valid_B)
        maxs["clip_ratio/high_max"] = nan_max(high_B, valid_B)
    elif loss_type == "cispo":
        add_mean("cispo_clip_ratio", ((coef_1 > eps_high) & (adv > 0)).astype(dtype))
    elif loss_type == "vespo":
        add_mean("vespo/phi_seq_mean", parts["phi_seq"])
    return {"sum": sums, "count": counts, "min": mins, "max": maxs}


def grpo_loss(
    per_token_logps_BT: jax.Array,
    advantages: jax.Array,
    mask_BT: jax.Array,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    example_mask_B: jax.Array | None = None,
    entropies_BT: jax.Array | None = None,
    token_count: jax.Array | float | None = None,
    entropy_coef: jax.Array | float | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """`(loss_sum, aux)` of one micro-batch, ready for a `make_train_step` loss function.

    Composes `grpo_per_token_loss` (`kwargs` go there), `grpo_aggregate` and `grpo_metrics`;
    `aux["sum"]["loss"]` / `aux["count"]["loss"]` carry the pair the step divides once.
    `loss_sum / count` of the whole step equals TRL's loss (summed over accumulation steps).

    `entropy_coef` (not None: TRL's entropy bonus is on, even at 0 as under adaptive control)
    subtracts `entropy_coef x H x count`, `H` the mean of `entropies_BT` over the loss's tokens
    (`mask_BT`, times `entropy_mask_BT` when given): TRL's `coef x H / accumulation steps` once
    the step divides by the summed counts of equally counted micro-batches (module docstring).
    `entropies_BT` is then differentiated (`token_logprobs(..., entropy_grad=True)` gives them
    their LM-head gradient). `aux` adds TRL's `policy_loss`, the loss without the bonus.
    """
    per_token_loss_BT, parts = grpo_per_token_loss(
        per_token_logps_BT,
        advantages,
        mask_BT,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        **kwargs,
    )
    loss_sum, count = grpo_aggregate(
        per_token_loss_BT,
        mask_BT,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        example_mask_B=example_mask_B,
        token_count=token_count,
    )
    aux = grpo_metrics(
        parts,
        advantages,
        mask_BT,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        entropies_BT=entropies_BT,
        example_mask_B=example_mask_B,
    )
    if entropy_coef is not None:
        if entropies_BT is None:
            raise ValueError("The entropy bonus (entropy_coef) needs entropies_BT.")
        mean_entropy = masked_entropy(
            entropies_BT,
            mask_BT,
            entropy_mask_BT=kwargs.get("entropy_mask_BT"),
            example_mask_B=example_mask_B,
        )
        aux["sum"]["policy_loss"] = jax.lax.stop_gradient(loss_sum)
        aux["count"]["policy_loss"] = count
        loss_sum = loss_sum - entropy_coef * mean_entropy * count
    aux["sum"]["loss"] = jax.lax.stop_gradient(loss_sum)
    aux["count"]["loss"] = count
    return loss_sum, aux


def entropy_bonus_mask(
    mask_BT: jax.Array,
    entropy_mask_BT: jax.Array | None = None,
    example_mask_B: jax.Array | None = None,
) -> jax.Array:
    """`[B, T]` f32 mask of the tokens the entropy bonus averages over: those the policy loss
    acts on (`mask_BT`, times the top-entropy mask when `top_entropy_quantile < 1`, as TRL's
    `effective_mask`), padding rows (`example_mask_B` 0) left out."""
    m_BT = mask_BT.astype(jnp.float32)
    if entropy_mask_BT is not None:
        m_BT = m_BT * entropy_mask_BT.astype(jnp.float32)
    if example_mask_B is not None:
        m_BT = m_BT * example_mask_B.astype(jnp.float32)[:, None]
    return m_BT


def masked_entropy(
    entropies_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    entropy_mask_BT: jax.Array | None = None,
    example_mask_B: jax.Array | None = None,
) -> jax.Array:
    """TRL's entropy-bonus `H` of one micro-batch: the mean entropy over `entropy_bonus_mask`'s
    tokens (0 when there is none), whatever the loss type's normaliser."""
    same_shape("masked_entropy", rank=2, entropies_BT=entropies_BT, mask_BT=mask_BT)
    m_BT = entropy_bonus_mask(mask_BT, entropy_mask_BT, example_mask_B)
    return jnp.sum(entropies_BT.astype(jnp.float32) * m_BT) / jnp.maximum(jnp.sum(m_BT), 1.0)
