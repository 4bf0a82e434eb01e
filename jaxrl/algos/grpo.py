"""GRPO's traced update (TRL 1.16 `GRPOTrainer._compute_loss`): the loss function of one
micro-batch for `make_train_step`, with the entropy-bonus controller it carries in the train
state, and the loss-unit counts the step divides by.

`make_loss(config, ...)` builds `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux,
extras))`: the policy's completion log-probs (`algos.rollout`), then `jaxrl.losses.grpo.grpo_loss`
with every TRL loss type, token- or sequence-level importance sampling, optional k3 KL to the
reference, top-entropy masking and the DAPO/BNPO/Dr.GRPO normalisers.

Entropy bonus (`entropy_coef`, `use_adaptive_entropy`). The loss subtracts `coef x H`, `H` each
micro-batch's mean entropy over the loss's tokens, divided by the accumulation steps as TRL does
(`grpo_loss(entropy_coef=...)`); the entropies get their gradient in the LM head's own backward
pass (`token_logprobs(..., entropy_grad=True)`, no extra matmul). Adaptive control keeps TRL's
controller state in the train state, `extras["entropy_control"]` (`init_extras`), so a
checkpoint holds it (TRL's `entropy_ctrl_state.json`): the coefficient and the entropy left by the
last optimizer step, and the entropy sum / token count of the current step's micro-batches so far
with their number. Each micro-batch applies the coefficient of the previous step, gated to 0 when
that step's entropy exceeded `entropy_target` (TRL's first step: no entropy yet, +inf, so no
bonus); the last micro-batch of an optimizer step moves it by `entropy_coef_delta` from the step's
token-weighted entropy over all its micro-batches and devices. Evaluation (a batch without
`num_items_in_batch`) applies the bonus with the state's gated coefficient and logs
`policy_loss`, but never updates the controller nor logs `entropy_coef`.

MoE load-balancing loss (`router_aux_loss_coef`): TRL adds `coef x aux_loss / accumulation
steps` to each micro-batch's loss after the entropy bonus, whatever the loss type (eval: `coef x
aux_loss`); `make_loss_units` is `grpo_count` summed over the step's micro-batches, the count the
step divides by.

`config` is a `GRPOConfig` (read for its fields only). No host work here: advantages from
rewards, sampling and logging stay in the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos import router_aux
from jaxrl.algos.rollout import (
    completion_logprobs,
    completion_logprobs_and_entropy,
    loss_mask,
    rollout_token_weights,
)
from jaxrl.losses.grpo import (
    adaptive_entropy_coef,
    entropy_bonus_coef,
    entropy_bonus_mask,
    grpo_count,
    grpo_loss,
    high_entropy_mask,
)

# The loss types normalised by the generation batch's active tokens (TRL's `num_items_in_batch`).
TOKEN_NORMALISED = ("dapo", "cispo", "vespo")


def entropy_bonus_enabled(config: Any) -> bool:
    """TRL's `_entropy_bonus_enabled`: a non-zero `entropy_coef`, or adaptive control (on
    even at 0, so that a coefficient decremented to `entropy_coef_min` can recover)."""
    return config.entropy_coef != 0.0 or config.use_adaptive_entropy


def init_extras(config: Any) -> dict:
    """The train state's `extras` entries `make_loss` reads and updates: the adaptive entropy
    controller's state (none without `use_adaptive_entropy`)."""
    if not config.use_adaptive_entropy:
        return {}
    return {
        "entropy_control": {
            "entropy_coef": jnp.float32(config.entropy_coef),
            "last_world_entropy": jnp.float32(jnp.inf),  # TRL's before any measurement
            "window": jnp.zeros(2, jnp.float32),  # [entropy sum, token count] of the step
            "micro_steps": jnp.int32(0),  # micro-batches of the step seen so far
        }
    }


def token_count(config: Any, mb: dict, steps_per_generation: int) -> jax.Array | None:
    """The `dapo`/`cispo`/`vespo` count of a training micro-batch (`grpo_loss`'s
    `token_count`): TRL normalises by the generation batch's tokens x accumulation /
    steps_per_generation per optimizer step, i.e. its tokens / steps_per_generation per
    micro-batch. None for the other types, and for an eval batch, which carries no
    `num_items_in_batch`: TRL's eval normaliser is the batch's own token count."""
    if config.loss_type in TOKEN_NORMALISED and "num_items_in_batch" in mb:
        return jnp.maximum(mb["num_items_in_batch"][0], 1.0) / steps_per_generation
    return None


def make_loss_units(config: Any, steps_per_generation: int) -> Callable[[dict], jax.Array]:
    """`units(batch_A) -> count`: the summed `grpo_count` of one step's micro-batches `batch_A`
    (leading axis: the micro-batches), what `make_train_step(loss_units=...)` takes."""
    loss_type = config.loss_type

    def micro_batch_count(mb: dict) -> jax.Array:
        return grpo_count(
            loss_mask(mb),
            loss_type=loss_type,
            token_count=token_count(config, mb, steps_per_generation),
        )

    def units(batch_A: dict) -> jax.Array:
        keys = ("completion_mask", "tool_mask", "num_items_in_batch")
        return jnp.sum(jax.vmap(micro_batch_count)({k: batch_A[k] for k in keys if k in batch_A}))

    return units


def make_loss(
    config: Any,
    apply_model: Callable[[Any, Any], Any],
    *,
    steps_per_generation: int,
    router_aux_loss_coef: float = 0.0,
) -> Callable:
    """The `make_train_step` loss of one GRPO micro-batch (see the module doc).

    `apply_model(params, state)` binds the trained params to the policy. The micro-batch dict
    holds the rollout rows (`input_ids`, `attention_mask`, `completion_mask`, optional
    `pixel_values`), `advantages` `[B]` and, when used, `old_logps`/`ref_logps` `[B, C]` and
    `num_items_in_batch` (training batches only).
    """
    a = config
    chunk = a.logprob_chunk_size
    loss_kwargs = dict(
        loss_type=a.loss_type,
        epsilon=a.epsilon,
        epsilon_high=a.epsilon_high,
        max_completion_length=a.max_completion_length,
        importance_sampling_level=a.importance_sampling_level,
        beta=a.beta,
        delta=a.delta,
        sapo_temperature_neg=a.sapo_temperature_neg,
        sapo_temperature_pos=a.sapo_temperature_pos,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
        use_bias_correction_kl=a.use_bias_correction_kl,
        off_policy_mask_threshold=a.off_policy_mask_threshold,
    )

    token_normalised = a.loss_type in TOKEN_NORMALISED

    bonus = entropy_bonus_enabled(a)
    adaptive = a.use_adaptive_entropy
    accum = a.gradient_accumulation_steps
    controller = dict(
        entropy_target=a.entropy_target,
        entropy_coef_delta=a.entropy_coef_delta,
        entropy_coef_min=a.entropy_coef_min,
        entropy_coef_max=a.entropy_coef_max,
    )

    aux_coef = router_aux_loss_coef

    def loss_fn(params, state, mb, rng, extras) -> tuple[jax.Array, Any]:
        model = apply_model(params, state)
        tokens_BT = rollout_token_weights(mb)
        # TRL: the policy's loss forward returns the MoE load-balancing loss (no other one).
        with router_aux.collect(bool(aux_coef), tokens_BT) as router_stats:
            if bonus:
                logps_BC, stats, entropies_BC = completion_logprobs_and_entropy(
                    model, mb, temperature=a.temperature, chunk_size=chunk
                )
            else:
                logps_BC, stats = completion_logprobs(
                    model, mb, temperature=a.temperature, chunk_size=chunk, with_stats=True
                )
                entropies_BC = stats["entropy"]
        mask_BC = loss_mask(mb)
        entropy_mask = (
            high_entropy_mask(stats["entropy"], mask_BC, a.top_entropy_quantile)
            if a.top_entropy_quantile < 1.0
            else None
        )
        coef = None
        if adaptive:
            # The step's coefficient: the state's (the previous optimizer step's), gated.
            ctrl = state.extras["entropy_control"]
            coef = entropy_bonus_coef(
                ctrl["entropy_coef"], ctrl["last_world_entropy"], a.entropy_target
            )
        elif bonus:
            coef = a.entropy_coef
        loss_sum, aux = grpo_loss(
            logps_BC,
            mb["advantages"],
            mask_BC,
            old_per_token_logps_BT=mb.get("old_logps"),
            ref_per_token_logps_BT=mb.get("ref_logps"),
            entropy_mask_BT=entropy_mask,
            entropies_BT=entropies_BC,
            entropy_coef=coef,
            token_count=token_count(a, mb, steps_per_generation),
            **loss_kwargs,
        )
        # TRL adds `coef x aux_loss / accumulation steps` (eval: / 1) after the entropy bonus.
        loss_sum = router_aux.add_to_loss(
            aux_coef, router_stats, tokens_BT, mb, loss_sum, aux["sum"], aux["count"]
        )
        # An eval batch carries no `num_items_in_batch` (`_eval_batch`): TRL's eval mode,
        # where `policy_loss` is the batch's and the controller neither moves nor logs.
        training = "num_items_in_batch" in mb
        if not (bonus and training):
            return loss_sum, (aux, extras)
        if token_normalised:
            # TRL's `policy_loss` of a token-normalised type is each micro-batch's share of
            # the step's loss (its normaliser spans the accumulation window), averaged over
            # the micro-batches: the step's policy loss / accumulation steps.
            aux["count"]["policy_loss"] = aux["count"]["policy_loss"] * accum
        if not adaptive:
            aux["sum"]["entropy_coef"] = jnp.float32(a.entropy_coef)
            aux["count"]["entropy_coef"] = jnp.float32(1.0)
            return loss_sum, (aux, extras)
        # The controller: this micro-batch's entropy joins the step's window; the last
        # micro-batch of the optimizer step moves the coefficient (TRL at sync_gradients).
        ctrl = extras["entropy_control"]
        m_BC = entropy_bonus_mask(mask_BC, entropy_mask)
        entropy_sum = jnp.sum(jax.lax.stop_gradient(stats["entropy"]) * m_BC)
        window = ctrl["window"] + jnp.stack([entropy_sum, jnp.sum(m_BC)])
        micro_steps = ctrl["micro_steps"] + 1
        last = micro_steps >= accum
        world_entropy = window[0] / jnp.maximum(window[1], 1.0)
        updated = adaptive_entropy_coef(ctrl["entropy_coef"], world_entropy, **controller)
        extras = {
            **extras,
            "entropy_control": {
                "entropy_coef": jnp.where(last, updated, ctrl["entropy_coef"]),
                "last_world_entropy": jnp.where(last, world_entropy, ctrl["last_world_entropy"]),
                "window": jnp.where(last, jnp.zeros_like(window), window),
                "micro_steps": jnp.where(last, 0, micro_steps),
            },
        }
        # TRL logs the coefficient once per optimizer step, after its update.
        aux["sum"]["entropy_coef"] = jnp.where(last, updated, 0.0)
        aux["count"]["entropy_coef"] = last.astype(jnp.float32)
        return loss_sum, (aux, extras)

    return loss_fn
