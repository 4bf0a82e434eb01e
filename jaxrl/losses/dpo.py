"""DPO-family preference losses on summed completion log-probs (TRL `DPOTrainer` semantics).

Pure functions of `[B]` arrays: no model calls, no host side effects, jit-able. Formulas follow
`trl/trainer/dpo_trainer.py` (TRL 1.16, `DPOTrainer._compute_loss`); each branch names the
paper it implements. `label_smoothing` is read by `robust`, `exo_pair`, `aot` and
`aot_unpaired` only, as in TRL 1.16 (`sigmoid` ignores it; TRL <= 0.2x made it conservative
DPO there). Two extensions reproduce older TRL behaviour that 1.16 dropped; each reduces exactly
to TRL 1.16 at its default:

- `bco_delta` is the running reward mean that TRL <= 0.2x subtracted in `bco_pair`. Keep it
  with `running_moments_init` / `running_moments_update`; the default 0.0 is TRL 1.16.
- `reference_free=True` scores against a uniform reference: reference log-probs are taken as
  zero everywhere (losses and rewards), as TRL's former `reference_free` flag did.

Rewards are `beta * (logps - ref_logps)` under `stop_gradient`, independent of `loss_type`
(TRL logs the same `rewards/*` whatever losses are combined).
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.core.shapes import same_shape

# The loss types that read `label_smoothing` (TRL 1.16's `_compute_loss`).
LABEL_SMOOTHING_TYPES = ("robust", "exo_pair", "aot", "aot_unpaired")
LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL: the f-DPO reparameterisation only cancels log Z(x) in the chosen-rejected score difference.
F_DIVERGENCE_LOSS_TYPES = (
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "robust",
    "discopop",
    "sft",
)
_LENGTH_LOSS_TYPES = ("ipo", "sigmoid_norm", "sft")


class RunningMoments(NamedTuple):
    """Running mean/variance of a stream (TRL <= 0.2x `RunningMoments`, MOSS-RLHF variant)."""

    mean: jax.Array
    std: jax.Array
    var: jax.Array
    count: jax.Array


def running_moments_init() -> RunningMoments:
    """TRL's initial moments: mean 0, std 1, var 1, count 1e-24 (so the first batch dominates)."""
    f32 = jnp.float32
    return RunningMoments(
        mean=jnp.zeros((), f32),
        std=jnp.ones((), f32),
        var=jnp.ones((), f32),
        count=jnp.array(1e-24, f32),
    )


def running_moments_update(state: RunningMoments, xs: jax.Array) -> RunningMoments:
    """Merges the (population) moments of all elements of `xs` into `state`.

    Chan et al. parallel merge, exactly as TRL's `RunningMoments.update`; `std` is the unbiased
    estimate `sqrt(var * n / (n - 1))`. For `bco_pair` TRL fed the scalar batch mean of
    `concat(chosen_rewards, rejected_rewards)` *before* computing the loss and used `mean` as delta.
    """
    xs = jnp.asarray(xs, jnp.float32)
    xs_count = jnp.asarray(xs.size, jnp.float32)
    xs_mean = jnp.mean(xs)
    xs_var = jnp.mean(jnp.square(xs - xs_mean))
    delta = xs_mean - state.mean
    tot_count = state.count + xs_count
    new_sum = xs_var * xs_count
    old_sum = state.var * state.count + jnp.square(delta) * state.count * xs_count / tot_count
    new_var = (old_sum + new_sum) / tot_count
    return RunningMoments(
        mean=state.mean + delta * xs_count / tot_count,
        std=jnp.sqrt(new_var * tot_count / (tot_count - 1)),
        var=new_var,
        count=tot_count,
    )


def _f_divergence_scores(
    logratios: jax.Array, f_divergence_type: str, alpha_coef: float
) -> jax.Array:
    """f'(pi/pi_ref) of the f-DPO paper (Wang et al. 2023), TRL `f_divergence_type`."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - jnp.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return jnp.log(2.0) + jax.nn.log_sigmoid(logratios)
    # alpha_divergence: f'(t) = (t^(a-1) - 1) / (a - 1); a -> 1 is reverse KL.
    if abs(alpha_coef - 1.0) < 1e-6:
        return logratios
    t = jnp.minimum((alpha_coef - 1.0) * logratios.astype(jnp.float32), 80.0)
    return ((jnp.exp(t) - 1.0) / (alpha_coef - 1.0)).astype(logratios.dtype)


def _validate(
    loss_type: str,
    f_divergence_type: str,
    label_smoothing: float,
    chosen_lengths: jax.Array | None,
    rejected_lengths: jax.Array | None,
) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"Unknown DPO loss_type {loss_type!r}; valid loss types are {list(LOSS_TYPES)}."
        )
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(
            f"Unknown f_divergence_type {f_divergence_type!r}; valid values are {list(F_DIVERGENCE_TYPES)}."
        )
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} is only defined for loss types "
            f"{list(F_DIVERGENCE_LOSS_TYPES)}, not {loss_type!r}; use f_divergence_type='reverse_kl'."
        )
    if (
        loss_type == "exo_pair"
        and isinstance(label_smoothing, (int, float))
        and label_smoothing <= 0
    ):
        raise ValueError(
            "loss_type='exo_pair' needs label_smoothing > 0 (it takes log(label_smoothing)); "
            "the EXO paper recommends label_smoothing=1e-3."
        )
    if loss_type in _LENGTH_LOSS_TYPES and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(
            f"loss_type={loss_type!r} is length-normalised: pass chosen_lengths and rejected_lengths "
            "(number of completion tokens per example)."
        )


def dpo_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: jax.Array | None = None,
    rejected_lengths: jax.Array | None = None,
    discopop_tau: float = 0.05,
    bco_delta: float | jax.Array = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    reference_free: bool = False,
    example_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-example DPO-family loss for one `loss_type` (TRL `DPOConfig.loss_type`).

    Args:
      policy_chosen_logps, policy_rejected_logps: `[B]` completion log-probs summed over tokens.
      ref_chosen_logps, ref_rejected_logps: `[B]` the same under the reference model.
      chosen_lengths, rejected_lengths: `[B]` completion token counts; required by the
        length-normalised types `ipo`, `sigmoid_norm` and `sft`.
      bco_delta: reward baseline subtracted by `bco_pair` (see module docstring).
      reference_free: ignore the reference log-probs (treat them as 0).
      example_mask: `[B]` 1 for real pairs, 0 for pairs that only fill a static batch shape.
        Only `aot`/`aot_unpaired` read it (they sort over the batch): padding pairs are kept
        out of the real pairs' quantiles. Other types are per pair: the caller weights them.

    Returns:
      `(losses_B, chosen_rewards_B, rejected_rewards_B)`. TRL's loss is `losses_B.mean()`.
      `aot`/`aot_unpaired` sort over the whole (global) batch axis, where TRL sorts each
      device's micro-batch; `sft` is the token-mean NLL of the chosen completions of the batch,
      broadcast to `[B]` as TRL does.
    """
    _validate(loss_type, f_divergence_type, label_smoothing, chosen_lengths, rejected_lengths)
    same_shape(
        "dpo_loss",
        rank=1,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=None if reference_free else ref_chosen_logps,
        ref_rejected_logps=None if reference_free else ref_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        example_mask=example_mask,
    )
    if reference_free:
        ref_chosen_logps = jnp.zeros_like(policy_chosen_logps)
        ref_rejected_logps = jnp.zeros_like(policy_rejected_logps)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    chosen_scores = _f_divergence_scores(
        chosen_logratios, f_divergence_type, f_alpha_divergence_coef
    )
    rejected_scores = _f_divergence_scores(
        rejected_logratios, f_divergence_type, f_alpha_divergence_coef
    )
    delta = chosen_scores - rejected_scores
    ls = label_smoothing
    log_sig = jax.nn.log_sigmoid

    if loss_type == "sigmoid":
        # DPO (Rafailov 2023) Eq. 7 (TRL 1.16: no label smoothing here).
        losses = -log_sig(beta * delta)
    elif loss_type == "hinge":
        # RSO / SLiC (Liu 2023): hinge on the reward margin.
        losses = jax.nn.relu(1 - beta * delta)
    elif loss_type == "ipo":
        # IPO (Azar 2023) Eq. 17 with TRL's per-token normalisation of the log-ratios.
        chosen_avg = chosen_scores / jnp.maximum(chosen_lengths, 1)
        rejected_avg = rejected_scores / jnp.maximum(rejected_lengths, 1)
        losses = jnp.square(chosen_avg - rejected_avg - 1 / (2 * beta))
    elif loss_type == "exo_pair":
        # EXO-pref (Ji 2024) Eq. 16: KL(softmax(beta * scores) || [1 - eps, eps]).
        logits = beta * delta
        losses = jax.nn.sigmoid(logits) * (log_sig(logits) - jnp.log1p(-ls)) + jax.nn.sigmoid(
            -logits
        ) * (log_sig(-logits) - jnp.log(ls))
    elif loss_type == "nca_pair":
        # NCA (Chen 2024), pairwise form.
        chosen_r, rejected_r = beta * chosen_logratios, beta * rejected_logratios
        losses = -log_sig(chosen_r) - 0.5 * log_sig(-chosen_r) - 0.5 * log_sig(-rejected_r)
    elif loss_type == "robust":
        # Robust DPO (Chowdhury 2024) Eq. 21: unbiased under label-flip rate `label_smoothing`.
        clean = -(1 - ls) * log_sig(beta * delta)
        flipped = -ls * log_sig(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * ls)
    elif loss_type == "bco_pair":
        # BCO (Jung 2024), pairwise, with reward baseline `bco_delta`.
        losses = -log_sig(beta * chosen_logratios - bco_delta) - log_sig(
            -(beta * rejected_logratios - bco_delta)
        )
    elif loss_type == "sppo_hard":
        # SPPO (Wu 2024) Eq. 4.7 with hard win probabilities P(chosen) = 1, P(rejected) = 0.
        losses = jnp.square(chosen_logratios - 0.5 / beta) + jnp.square(
            rejected_logratios + 0.5 / beta
        )
    elif loss_type in ("aot", "aot_unpaired"):
        # AOT (Melnyk 2024): align the sorted (quantile) distributions over the batch.
        keep = (
            jnp.ones(policy_chosen_logps.shape, bool) if example_mask is None else example_mask > 0
        )

        def sort(x):  # the real pairs' values in order, padding pairs' after them
            return jnp.sort(jnp.where(keep, x, jnp.finfo(x.dtype).max), axis=0)

        if loss_type == "aot":
            d = sort(policy_chosen_logps - policy_rejected_logps) - sort(
                ref_chosen_logps - ref_rejected_logps
            )
        else:
            d = sort(chosen_logratios) - sort(rejected_logratios)
        losses = -log_sig(beta * d) * (1 - ls) - log_sig(-beta * d) * ls
        # Rank i's loss goes to the i-th real pair's slot, so weighting by the mask keeps the
        # real ranks (padding ranks have d = 0: finite, and weighted 0).
        losses = jnp.zeros_like(losses).at[jnp.argsort(~keep, stable=True)].set(losses)
    elif loss_type == "apo_zero":
        # APO-zero (D'Oosterlinck 2024) Eq. 7: raise chosen, lower rejected likelihood.
        losses = (1 - jax.nn.sigmoid(beta * chosen_logratios)) + jax.nn.sigmoid(
            beta * rejected_logratios
        )
    elif loss_type == "apo_down":
        # APO-down Eq. 8: lower both, rejected more.
        losses = jax.nn.sigmoid(beta * chosen_logratios) + (
            1 - jax.nn.sigmoid(beta * (chosen_logratios - rejected_logratios))
        )
    elif loss_type == "discopop":
        # DiscoPOP (Chris Lu 2024) Eq. 5: log-ratio-modulated blend of logistic and exponential.
        logits = beta * delta
        modulation = jax.nn.sigmoid(logits / discopop_tau)
        losses = -log_sig(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
    elif loss_type == "sft":
        # NLL of the chosen completions, averaged over all chosen tokens of the batch (TRL).
        mean_nll = -jnp.sum(policy_chosen_logps) / jnp.maximum(jnp.sum(chosen_lengths), 1)
        losses = jnp.broadcast_to(mean_nll, policy_chosen_logps.shape)
    else:  # sigmoid_norm: DPO on per-token average scores.
        chosen_avg = chosen_scores / jnp.maximum(chosen_lengths, 1)
        rejected_avg = rejected_scores / jnp.maximum(rejected_lengths, 1)
        losses = -log_sig(beta * (chosen_avg - rejected_avg))

    chosen_rewards = jax.lax.stop_gradient(beta * chosen_logratios)
    rejected_rewards = jax.lax.stop_gradient(beta * rejected_logratios)
    return losses, chosen_rewards, rejected_rewards


def dpo_multi_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    *,
    loss_types: Sequence[str],
    loss_weights: Sequence[float] | None = None,
    **kwargs,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted sum of several DPO losses (TRL `loss_type=[...]`, `loss_weights`, e.g. MPO).

    TRL's scalar loss is `sum_k w_k * mean_B(loss_k)`, which equals the mean over `B` of the
    per-example `sum_k w_k * loss_k` returned here. Weights default to 1.0 each. Rewards do not
    depend on the loss types, so they are returned once. `kwargs` go to `dpo_loss`.
    """
    loss_types = list(loss_types)
    if not loss_types:
        raise ValueError("loss_types is empty; pass at least one DPO loss type, e.g. ['sigmoid'].")
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(
            f"loss_weights has {len(weights)} entries for {len(loss_types)} loss_types; "
            "give one weight per loss type (or none for equal weights)."
        )
    total = None
    for loss_type, weight in zip(loss_types, weights, strict=True):
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen_logps,
            policy_rejected_logps,
            ref_chosen_logps,
            ref_rejected_logps,
            loss_type=loss_type,
            **kwargs,
        )
        total = weight * losses if total is None else total + weight * losses
    return total, chosen_rewards, rejected_rewards
