"""The traced math of Kahneman-Tversky optimisation (TRL `KTOTrainer`): summed completion
log-probs of a micro-batch's rows and of its mismatched KL rows, the KL reference point, the
losses of `loss_type` "kto" and "apo_zero_unpaired", and the loss factory the generic step
differentiates.

A KTO micro-batch holds `B` unpaired rows `prompt + completion` (`input_ids`, `targets`,
`attention_mask`, `positions`, `loss_mask` `[B, T]`, `loss_mask` on the completion targets),
their `label` `[B]` (1.0: desirable) and, when the loss estimates the KL term, the same keys
prefixed `KL_` for the rows `prompt_i + completion_{i-1}` (`jaxrl.data.kto`). Nothing here reads
datasets, collates, loads a reference or touches the host loop (`jaxrl.trainers.kto`).

Formulas (TRL 1.16, Eq. 7 of https://huggingface.co/papers/2402.01306; APO-zero unpaired from
https://huggingface.co/papers/2408.06266), with `r = logp - ref_logp` per row:
    z0 = max(0, mean over the micro-batch of (KL_logp - ref_KL_logp)), without gradient
    kto:                 desirable 1 - sigmoid(beta (r - z0)),  undesirable 1 - sigmoid(beta (z0 - r))
    apo_zero_unpaired:   desirable 1 - sigmoid(beta r),         undesirable sigmoid(beta r)
    loss = mean over rows of (desirable_weight | undesirable_weight) * row loss
    rewards = beta * r (no gradient)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.algos import router_aux
from jaxrl.algos.masks import weighted_token_count
from jaxrl.algos.sft import full_logits, lm_forward
from jaxrl.models.adapters import adapter_off

LOSS_TYPES = ("kto", "apo_zero_unpaired")
ROW_KEYS = ("input_ids", "targets", "attention_mask", "positions", "loss_mask")
KL_PREFIX = "KL_"


def estimates_kl(loss_type: str) -> bool:
    """Whether `loss_type` uses the KL reference point (TRL's `calculate_KL`)."""
    return loss_type != "apo_zero_unpaired"


def rows(mb: dict, prefix: str = "") -> dict:
    """The LM rows of a KTO micro-batch: the main rows, or with `prefix="KL_"` the KL rows."""
    return {k: mb[prefix + k] for k in ROW_KEYS}


def completion_logps(model, rows_: dict, chunk: int | None, with_stats: bool = False):
    """Summed completion log-probs `[B]` of LM rows (and, with stats, the per-token `[B, T]`
    statistics of `jaxrl.core.logprobs.token_logprobs`)."""
    out = lm_forward(model, rows_, chunk, with_stats)
    logps_BT, stats = out if with_stats else (out, None)
    logps_B = jnp.sum(logps_BT * rows_["loss_mask"], axis=-1)
    return (logps_B, stats) if with_stats else logps_B


def reference_logps(model, mb: dict, chunk: int | None, with_kl: bool):
    """The reference's summed completion log-probs `[B]` of the main rows and (with `with_kl`)
    of the KL rows (else None), without gradient."""
    ref_B = jax.lax.stop_gradient(completion_logps(model, rows(mb), chunk))
    if not with_kl:
        return ref_B, None
    return ref_B, jax.lax.stop_gradient(completion_logps(model, rows(mb, KL_PREFIX), chunk))


def make_reference_logps(
    config: Any, bind_reference: Callable[[Any], Any], *, lora_base: bool, with_kl: bool
) -> Callable[[Any, dict], tuple[jax.Array, jax.Array | None]]:
    """`ref_logps(state, mb) -> (main, KL or None)` (`make_loss`'s `ref_logps`).
    `bind_reference(state)` is the reference model of the train state; with `lora_base` it is
    the LoRA policy's base, traced with every adapter off."""

    def ref_logps(state, mb):
        with adapter_off(lora_base):  # read when traced: the call must be inside
            return reference_logps(bind_reference(state), mb, config.logprob_chunk_size, with_kl)

    return ref_logps


def make_precompute_logps(
    graphdef: Any, config: Any, *, with_kl: bool, lora_base: bool
) -> Callable[[Any, dict], jax.Array]:
    """`logps(params, batch) -> [B, 2]` (main, KL; main twice without the KL term): one
    reference pass over a batch for `precompute_ref_log_probs`, the model `graphdef` bound to
    `params` (with `lora_base`, a LoRA policy's base without its adapter)."""

    def logps(params, batch):
        with adapter_off(lora_base):
            main, kl = reference_logps(
                nnx.merge(graphdef, params), batch, config.logprob_chunk_size, with_kl
            )
        return jnp.stack([main, main if kl is None else kl], axis=1)

    return logps


def predict(model, mb: dict) -> tuple[jax.Array, jax.Array]:
    """TRL's `prediction_step`: the logits of the `prompt + completion` rows, labelled with their
    input ids."""
    return full_logits(model, rows(mb)), mb["input_ids"]


def kl_estimate(kl_logps_B: jax.Array, ref_kl_logps_B: jax.Array, w_B: jax.Array) -> jax.Array:
    """KTO's reference point z0: the mean over the real rows (`w_B`) of the KL rows' log-ratios,
    clamped at 0, without gradient (TRL: `(KL_logps - ref_KL_logps).mean().clamp(min=0)`)."""
    mean = jnp.sum((kl_logps_B - ref_kl_logps_B) * w_B) / jnp.maximum(jnp.sum(w_B), 1)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))


def kto_losses(
    logps_B: jax.Array,
    ref_logps_B: jax.Array,
    label_B: jax.Array,
    kl: jax.Array | float,
    *,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-row weighted losses `[B]` and rewards `[B]` (`beta * (logps - ref_logps)`, no
    gradient) of rows labelled desirable (`label_B` true) or undesirable; formulas in the
    module docstring. `kl` is ignored by "apo_zero_unpaired"."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"KTO loss_type {loss_type!r} is not one of {list(LOSS_TYPES)}.")
    r_B = logps_B - ref_logps_B
    if loss_type == "kto":
        desirable_B = 1.0 - jax.nn.sigmoid(beta * (r_B - kl))
        undesirable_B = 1.0 - jax.nn.sigmoid(beta * (kl - r_B))
    else:
        desirable_B = 1.0 - jax.nn.sigmoid(beta * r_B)
        undesirable_B = jax.nn.sigmoid(beta * r_B)
    losses_B = jnp.where(
        label_B > 0, desirable_weight * desirable_B, undesirable_weight * undesirable_B
    )
    return losses_B, beta * jax.lax.stop_gradient(r_B)


def _mean_if_any(total: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(value, 1) when `count` > 0, else (0, 0): summed over micro-batches and divided
    (`jaxrl.core.step.reduce_aux`), the mean of the micro-batch means that have the quantity,
    as TRL appends a metric only for the micro-batches that have it."""
    present = (count > 0).astype(jnp.float32)
    return total / jnp.maximum(count, 1) * present, present


# The metrics of one label's rows (or of both: the margin); a step whose micro-batches have no
# row of that label logs none (TRL appends them only for micro-batches that have such rows).
LABEL_METRICS = tuple(
    f"{m}/{side}" for m in ("rewards", "logps", "logits") for side in ("chosen", "rejected")
) + ("rewards/margins",)
PRESENT = "present/"


def with_absent_as_nan(metrics: dict) -> dict:
    """A train step's reduced metrics with the `PRESENT` counts removed and each
    `LABEL_METRICS` value NaN where no micro-batch had it (the loop then leaves it out of its
    logging window, as TRL's `log()` does with a metric it never appended)."""
    out = {k: v for k, v in metrics.items() if not k.startswith(PRESENT)}
    for k in LABEL_METRICS:
        if PRESENT + k in metrics:
            out[k] = jnp.where(metrics[PRESENT + k] > 0, metrics[k], jnp.nan)
    return out


def loss_units(batch_A: dict) -> jax.Array:
    """The loss units (real rows) of a whole `[A, B, ...]` train batch, known before its
    forward (`jaxrl.core.step.make_loss_and_grads`'s `loss_units`)."""
    return jnp.sum(batch_A["example_mask"])


def make_loss(
    config: Any,
    apply_model: Callable[[Any, Any], Any],
    *,
    ref_logps: Callable[[Any, dict], tuple[jax.Array, jax.Array | None]] | None = None,
    router_aux_coef: float = 0.0,
) -> Callable:
    """The KTO loss `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux, extras))` of
    `jaxrl.core.step` (per row) from a `KTOConfig` (`loss_type`, `beta`, `desirable_weight`,
    `undesirable_weight`, `precompute_ref_log_probs`, `logprob_chunk_size`).

    `apply_model(params, state)` is the policy bound to `params`; `ref_logps(state, mb)` the
    reference's `(main, KL)` log-probs `[B]` (`reference_logps` of whichever model is the
    reference), needed unless the batch carries precomputed ones (`mb["ref_logps"]`,
    `mb["ref_KL_logps"]` `[B]`); `router_aux_coef` the resolved MoE load-balancing coefficient.

    Metrics (TRL's names, each the mean over the micro-batches that have it of its per-micro-
    batch mean, as TRL logs them): `kl`, `rewards/chosen`, `rewards/rejected`,
    `rewards/margins`, `logps/chosen`, `logps/rejected`, `logits/chosen`, `logits/rejected`
    (per completion token), `entropy` (per completion token) and the running `num_tokens`.
    """
    a = config
    chunk = a.logprob_chunk_size
    with_kl = estimates_kl(a.loss_type)
    coef = router_aux_coef
    if not a.precompute_ref_log_probs and ref_logps is None:
        raise ValueError(
            "KTO's make_loss needs ref_logps (the reference forward) unless "
            "precompute_ref_log_probs is set."
        )

    def loss_fn(params, state, mb, rng, extras):
        model = apply_model(params, state)
        main = rows(mb)
        w_B = mb["example_mask"] if "example_mask" in mb else jnp.ones(main["input_ids"].shape[0])
        tokens_BT = main["attention_mask"].astype(jnp.float32) * w_B[:, None]
        with router_aux.collect(bool(coef), tokens_BT) as router_stats:
            logps_B, stats = completion_logps(model, main, chunk, with_stats=True)
        if a.precompute_ref_log_probs:
            ref_B, ref_kl_B = mb["ref_logps"], mb.get("ref_KL_logps")
        else:
            ref_B, ref_kl_B = ref_logps(state, mb)
        kl = jnp.float32(0.0)
        if with_kl:
            # TRL runs the policy's KL forward without gradient.
            kl_B = jax.lax.stop_gradient(completion_logps(model, rows(mb, KL_PREFIX), chunk))
            kl = kl_estimate(kl_B, ref_kl_B, w_B)
        label_B = mb["label"]
        losses_B, rewards_B = kto_losses(
            logps_B,
            ref_B,
            label_B,
            kl,
            beta=a.beta,
            loss_type=a.loss_type,
            desirable_weight=a.desirable_weight,
            undesirable_weight=a.undesirable_weight,
        )
        n = jnp.sum(w_B)
        loss_sum = jnp.sum(losses_B * w_B)
        chosen_B, rejected_B = w_B * (label_B > 0), w_B * (label_B <= 0)
        n_c, n_r = jnp.sum(chosen_B), jnp.sum(rejected_B)
        mask_BT = main["loss_mask"]
        sums, counts = {"loss": loss_sum}, {"loss": n}
        values = {
            "rewards/chosen": (jnp.sum(rewards_B * chosen_B), n_c),
            "rewards/rejected": (jnp.sum(rewards_B * rejected_B), n_r),
            "logps/chosen": (jax.lax.stop_gradient(jnp.sum(logps_B * chosen_B)), n_c),
            "logps/rejected": (jax.lax.stop_gradient(jnp.sum(logps_B * rejected_B)), n_r),
        }
        for side, rows_B in (("chosen", chosen_B), ("rejected", rejected_B)):
            m_BT = mask_BT * rows_B[:, None]
            values[f"logits/{side}"] = (jnp.sum(stats["logit_mean"] * m_BT), jnp.sum(m_BT))
        for name, (total, count) in values.items():
            sums[name], counts[name] = _mean_if_any(total, count)
        # `kl` and `entropy` are logged for every micro-batch with rows (entropy 0 when it has
        # no completion token).
        has_rows = (n > 0).astype(jnp.float32)
        m_BT = mask_BT * w_B[:, None]
        entropy, _ = _mean_if_any(jnp.sum(stats["entropy"] * m_BT), jnp.sum(m_BT))
        sums["kl"], sums["entropy"] = kl * has_rows, entropy * has_rows
        counts["kl"] = counts["entropy"] = has_rows
        both = counts["rewards/chosen"] * counts["rewards/rejected"]
        sums["rewards/margins"] = (sums["rewards/chosen"] - sums["rewards/rejected"]) * both
        counts["rewards/margins"] = both
        loss_sum = router_aux.add_to_loss(coef, router_stats, tokens_BT, mb, loss_sum, sums, counts)
        totals = {
            "num_tokens": weighted_token_count(main["attention_mask"], mb).astype(jnp.float32)
        }
        # How many micro-batches had each label-dependent metric (`with_absent_as_nan`).
        totals.update({PRESENT + k: counts[k] for k in LABEL_METRICS})
        aux = {"sum": sums, "count": counts, "total": totals}
        return loss_sum, (aux, extras)

    return loss_fn
