"""Pure jnp building blocks of on-policy RL with TRL v0.7.2 semantics (`trl/core.py`,
`trl/trainer/utils.py`, `PPOTrainer.compute_rewards/compute_advantages`).

Masked statistics, whitening, KL penalties (incl. the full-vocabulary KL computed chunk by chunk
from two models' hidden states), GAE as a reverse `lax.scan`, per-token rewards, and the KL
controllers and running score moments as optax-style `(init, update)` pairs with NamedTuple
states, so they live in a jitted step and in checkpoints. Nothing here calls a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core import loops
from jaxrl.core.logprobs import SMALL_CHUNK_SIZE, resolve_chunk_size, unembed_logits
from jaxrl.core.shapes import same_shape, shape_is

KL_PENALTIES = ("kl", "abs", "mse", "full")
_WHITEN_EPS = 1e-8  # TRL's rsqrt(var + 1e-8)


# ----------------------------------------------------------------------------- statistics


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """`sum(values * mask) / sum(mask)` (TRL `masked_mean`; no guard against an empty mask)."""
    mask = mask.astype(values.dtype)
    if axis is None:
        return jnp.sum(values * mask) / jnp.sum(mask)
    return jnp.sum(values * mask, axis=axis) / jnp.sum(mask, axis=axis)


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Masked variance; `unbiased` rescales by n / (n - 1) with n = sum(mask) (TRL `masked_var`).

    TRL raises on an empty mask (n == 0) and divides by zero for n == 1; under jit neither can
    raise, so n == 0 gives NaN and n == 1 gives inf, the values the division produces.
    """
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask.astype(values.dtype))
        var = var * n / (n - 1)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """`(values - mean) * rsqrt(var + 1e-8)` over masked entries (unbiased var); with
    `shift_mean=False` the mean is added back (TRL `masked_whiten`). Unmasked entries are
    transformed too (the caller masks them)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def whiten(values: jax.Array, shift_mean: bool = True) -> jax.Array:
    """Unmasked `masked_whiten` with torch.var's unbiased variance (TRL `whiten`)."""
    mean, var = jnp.mean(values), jnp.var(values, ddof=1)
    whitened = (values - mean) * jax.lax.rsqrt(var + _WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def clip_by_value(x: jax.Array, low: jax.Array, high: jax.Array) -> jax.Array:
    """`max(min(x, high), low)`: element-wise bounds (TRL `clip_by_value`)."""
    return jnp.maximum(jnp.minimum(x, high), low)


def entropy_from_logits(logits: jax.Array, chunk_size: int | None = None) -> jax.Array:
    """`logsumexp(logits) - sum(softmax(logits) * logits)` over the last axis, in f32.

    With `chunk_size`, the vocabulary is reduced in chunks with an online (running max) softmax,
    so no f32 copy of the whole `[..., V]` input is made.
    """
    if chunk_size is None or chunk_size >= logits.shape[-1]:
        x = logits.astype(jnp.float32)
        log_z = jax.nn.logsumexp(x, axis=-1)
        return log_z - jnp.sum(jax.nn.softmax(x, axis=-1) * x, axis=-1)
    vocab = logits.shape[-1]
    n_chunks = -(-vocab // chunk_size)
    pad = n_chunks * chunk_size - vocab
    padded = jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    chunks = jnp.moveaxis(padded.reshape(*logits.shape[:-1], n_chunks, chunk_size), -2, 0)

    # Running (max m, sum exp(x - m), sum exp(x - m) * x) over vocabulary chunks.
    def body(carry, chunk):
        m, s, sx = carry
        x = chunk.astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(x, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(x - m_new[..., None])
        x_safe = jnp.where(jnp.isfinite(x), x, 0.0)
        return (m_new, s * scale + jnp.sum(e, -1), sx * scale + jnp.sum(e * x_safe, -1)), None

    shape = logits.shape[:-1]
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape))
    (m, s, sx), _ = loops.scan(body, init, chunks)
    return m + jnp.log(s) - sx / s


# ----------------------------------------------------------------------------- KL penalties


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, kind: str = "kl") -> jax.Array:
    """Per-token KL penalty estimate from the sampled tokens' log-probs (TRL `_kl_penalty`).

    `kl`: lp - ref; `abs`: |lp - ref|; `mse`: 0.5 (lp - ref)^2; `full`: `logprobs`/`ref_logprobs`
    are full-vocabulary log-softmax `[..., V]` and the result is KL(policy || ref) per position
    (use `full_kl_from_hidden` to avoid materialising them).
    """
    same_shape("kl_penalty", logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind == "kl":
        return logprobs - ref_logprobs
    if kind == "abs":
        return jnp.abs(logprobs - ref_logprobs)
    if kind == "mse":
        return 0.5 * jnp.square(logprobs - ref_logprobs)
    if kind == "full":
        return jnp.sum(jnp.exp(logprobs) * (logprobs - ref_logprobs), axis=-1)
    raise ValueError(f"kl_penalty={kind!r} is not supported; use one of {KL_PENALTIES}.")


def full_kl_from_hidden(
    hidden_BTD: jax.Array,
    unembed_DV: jax.Array,
    ref_hidden_BTD: jax.Array,
    ref_unembed_DV: jax.Array,
    *,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    ref_logit_softcap: float | None = None,
) -> jax.Array:
    """Per-position KL(policy || ref) over the whole vocabulary, `[B, T]` f32, from both models'
    final hidden states and unembeddings (TRL's `kl_penalty="full"`), each model's logits
    soft-capped with its own cap when it has one. Logits are formed one `[B, chunk, V]` block of
    T at a time, never for the whole sequence."""
    shape_is("full_kl_from_hidden", (None, None, None), hidden_BTD=hidden_BTD)
    B, T, D = hidden_BTD.shape
    shape_is("full_kl_from_hidden", (D, None), unembed_DV=unembed_DV)
    shape_is("full_kl_from_hidden", (B, T, None), ref_hidden_BTD=ref_hidden_BTD)
    shape_is(
        "full_kl_from_hidden",
        (ref_hidden_BTD.shape[-1], unembed_DV.shape[1]),
        ref_unembed_DV=ref_unembed_DV,
    )
    # Each chunk holds both models' f32 log-softmax over the vocabulary, several times what the
    # fused head holds per logit, so None keeps 128-position chunks on every backend here.
    if chunk_size is None:
        chunk_size = SMALL_CHUNK_SIZE
    chunk = min(resolve_chunk_size(chunk_size, B, T, unembed_DV.shape[1], unembed_DV.dtype), T)
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(h_BTD):
        h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
        return h_BTD.reshape(B, n, chunk, h_BTD.shape[-1]).swapaxes(0, 1)

    def body(_, xs):
        h, h_ref = xs
        lp = jax.nn.log_softmax(unembed_logits(h, unembed_DV, logit_softcap), -1)
        ref_lp = jax.nn.log_softmax(unembed_logits(h_ref, ref_unembed_DV, ref_logit_softcap), -1)
        return None, kl_penalty(lp, ref_lp, "full")

    _, kl_NBC = loops.scan(body, None, (chunks(hidden_BTD), chunks(ref_hidden_BTD)))
    return kl_NBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]


# ----------------------------------------------------------------------------- rewards, GAE


def last_index(mask_BT: jax.Array) -> jax.Array:
    """[B] index of the last position with mask != 0 (0 for an all-zero row)."""
    idx_BT = jnp.arange(mask_BT.shape[1], dtype=jnp.int32)[None, :] * (mask_BT != 0)
    return jnp.max(idx_BT, axis=1)


def compute_rewards(
    scores_B: jax.Array, kl_BT: jax.Array, mask_BT: jax.Array, kl_coef: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per-token rewards `(rewards_BT, non_score_reward_BT)` (TRL `compute_rewards`).

    `non_score_reward = -kl_coef * kl` at every position (not masked); the score is added at the
    last position whose mask is 1 (the last response token, or last unmasked token).
    """
    same_shape("compute_rewards", rank=2, kl_BT=kl_BT, mask_BT=mask_BT)
    shape_is("compute_rewards", kl_BT.shape[:1], scores_B=scores_B)
    non_score_BT = -kl_coef * kl_BT
    last_B = last_index(mask_BT)
    onehot_BT = jax.nn.one_hot(last_B, kl_BT.shape[1], dtype=non_score_BT.dtype)
    return non_score_BT + onehot_BT * scores_B[:, None].astype(non_score_BT.dtype), non_score_BT


def gae(values_BT: jax.Array, rewards_BT: jax.Array, gamma: float, lam: float) -> jax.Array:
    """Generalised advantage estimates (Schulman et al. 2016) as a reverse scan over T:
    `delta_t = r_t + gamma V_{t+1} - V_t`, `A_t = delta_t + gamma lam A_{t+1}`, V_T = 0."""
    same_shape("gae", rank=2, values_BT=values_BT, rewards_BT=rewards_BT)
    next_values_BT = jnp.concatenate([values_BT[:, 1:], jnp.zeros_like(values_BT[:, :1])], 1)
    deltas_TB = (rewards_BT + gamma * next_values_BT - values_BT).T

    def body(last, delta_B):
        adv_B = delta_B + gamma * lam * last
        return adv_B, adv_B

    _, adv_TB = loops.scan(body, jnp.zeros_like(deltas_TB[0]), deltas_TB, reverse=True)
    return adv_TB.T


def compute_advantages(
    values_BT: jax.Array,
    rewards_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    gamma: float,
    lam: float,
    whiten_rewards: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(values, advantages, returns)` as TRL `compute_advantages`: values and rewards masked,
    optionally rewards whitened without mean shift (`whiten_rewards`, TRL v0.7.3), GAE,
    `returns = advantages + values`, then advantages whitened over the mask."""
    same_shape(
        "compute_advantages", rank=2, values_BT=values_BT, rewards_BT=rewards_BT, mask_BT=mask_BT
    )
    mask_BT = mask_BT.astype(values_BT.dtype)
    values_BT = values_BT * mask_BT
    rewards_BT = rewards_BT * mask_BT
    if whiten_rewards:
        rewards_BT = masked_whiten(rewards_BT, mask_BT, shift_mean=False)
    advantages_BT = gae(values_BT, rewards_BT, gamma, lam)
    returns_BT = advantages_BT + values_BT
    advantages_BT = masked_whiten(advantages_BT, mask_BT)
    return values_BT, jax.lax.stop_gradient(advantages_BT), returns_BT


# ----------------------------------------------------------------------------- KL controllers


class KLControllerState(NamedTuple):
    value: jax.Array  # f32 scalar: the current KL coefficient


class KLController(NamedTuple):
    """`init() -> state`, `update(state, current_kl, n_steps) -> state` (optax style)."""

    init: Callable[[], KLControllerState]
    update: Callable[..., KLControllerState]


def adaptive_kl_controller(init_kl_coef: float, target: float, horizon: float) -> KLController:
    """Ziegler et al. 2019 adaptive coefficient (TRL `AdaptiveKLController`):
    `e = clip(kl / target - 1, -0.2, 0.2)`, `value *= 1 + e * n_steps / horizon`."""

    def init() -> KLControllerState:
        return KLControllerState(jnp.asarray(init_kl_coef, jnp.float32))

    def update(state: KLControllerState, current_kl, n_steps) -> KLControllerState:
        error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target - 1, -0.2, 0.2)
        return KLControllerState(state.value * (1 + error * n_steps / horizon))

    return KLController(init, update)


def fixed_kl_controller(kl_coef: float) -> KLController:
    """Constant coefficient (TRL `FixedKLController`)."""

    def init() -> KLControllerState:
        return KLControllerState(jnp.asarray(kl_coef, jnp.float32))

    def update(state: KLControllerState, current_kl, n_steps) -> KLControllerState:
        del current_kl, n_steps
        return state

    return KLController(init, update)


# ----------------------------------------------------------------------------- running moments


class RunningMomentsState(NamedTuple):
    mean: jax.Array
    std: jax.Array
    var: jax.Array
    count: jax.Array


def running_moments_init() -> RunningMomentsState:
    """TRL `RunningMoments` start: mean 0, std 1, var 1, count 1e-24."""
    f32 = jnp.float32
    return RunningMomentsState(
        jnp.zeros((), f32), jnp.ones((), f32), jnp.ones((), f32), jnp.asarray(1e-24, f32)
    )


def running_moments_update(
    state: RunningMomentsState, xs: jax.Array
) -> tuple[RunningMomentsState, tuple[jax.Array, jax.Array]]:
    """Merge all elements of `xs` (Chan et al. parallel update, TRL `RunningMoments.update`).

    Returns the new state and the batch's `(mean, unbiased std)`. The running `std` is
    `sqrt(var * count / (count - 1))`.
    """
    xs = jnp.asarray(xs, jnp.float32)
    n = jnp.asarray(xs.size, jnp.float32)
    xs_mean = jnp.mean(xs)
    xs_var = jnp.mean(jnp.square(xs - xs_mean))
    delta = xs_mean - state.mean
    total = state.count + n
    old_sum = state.var * state.count + jnp.square(delta) * state.count * n / total
    var = (old_sum + xs_var * n) / total
    new = RunningMomentsState(
        mean=state.mean + delta * n / total,
        std=jnp.sqrt(var * total / (total - 1)),
        var=var,
        count=total,
    )
    return new, (xs_mean, jnp.sqrt(xs_var * n / (n - 1)))


def scale_scores(
    scores_B: jax.Array,
    moments: RunningMomentsState,
    *,
    use_score_scaling: bool,
    use_score_norm: bool,
    score_clip: float | None,
) -> tuple[jax.Array, RunningMomentsState]:
    """TRL `step()` score preprocessing: with `use_score_scaling` the running moments are updated
    with this batch first, then scores are divided by `std + eps` (and centred with
    `use_score_norm`); then clipped to `[-score_clip, score_clip]`."""
    if use_score_scaling:
        moments, _ = running_moments_update(moments, scores_B)
        factor = moments.std.astype(scores_B.dtype) + jnp.finfo(scores_B.dtype).eps
        if use_score_norm:
            scores_B = (scores_B - moments.mean.astype(scores_B.dtype)) / factor
        else:
            scores_B = scores_B / factor
    if score_clip is not None:
        scores_B = jnp.clip(scores_B.astype(jnp.float32), -score_clip, score_clip).astype(
            scores_B.dtype
        )
    return scores_B, moments
