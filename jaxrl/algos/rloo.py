"""RLOO's traced update (TRL 1.16 `RLOOTrainer._compute_loss`): the loss function of one
micro-batch for `make_train_step`, and the loss-unit count the step divides by.

`make_loss(config, ...)` builds `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux,
extras))`: the policy's completion log-probs (`algos.rollout`), then
`jaxrl.losses.rloo.rloo_loss`, a PPO-clipped surrogate on the *sequence* log-prob ratio against
the sampling policy's summed log-probs. With a mixture-of-experts policy
(`router_aux_loss_coef`) each micro-batch's loss adds `coef x aux_loss`, which HF's Trainer then
divides by the accumulation steps as it does RLOO's loss (`loss_units`: the step's sequences).

`config` is an `RLOOConfig` (read for its fields only). The leave-one-out advantages with the
KL-shaped reward come from rewards on the host (`jaxrl.losses.rloo.rloo_advantages`, called by
the trainer); nothing here samples, scores or logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos import router_aux
from jaxrl.algos.rollout import completion_logprobs, loss_mask, rollout_token_weights
from jaxrl.losses.rloo import rloo_loss


def loss_units(batch_A: dict) -> jax.Array:
    """The loss-unit count of one step's micro-batches `batch_A`: `rloo_loss` counts
    sequences, so the step's rows."""
    return jnp.asarray(batch_A["advantages"].size, jnp.float32)


def make_loss(
    config: Any, apply_model: Callable[[Any, Any], Any], *, router_aux_loss_coef: float = 0.0
) -> Callable:
    """The `make_train_step` loss of one RLOO micro-batch (see the module doc).

    `apply_model(params, state)` binds the trained params to the policy. The micro-batch dict
    holds the rollout rows (`input_ids`, `attention_mask`, `completion_mask`, optional
    `pixel_values`), `advantages` `[B]` and, in training, the sampling policy's `old_logps`
    `[B, C]`.
    """
    a = config
    chunk = a.logprob_chunk_size
    aux_coef = router_aux_loss_coef

    def loss_fn(params, state, mb, rng, extras) -> tuple[jax.Array, Any]:
        model = apply_model(params, state)
        tokens_BT = rollout_token_weights(mb)
        # TRL: the policy's loss forward returns the MoE load-balancing loss (no other one).
        with router_aux.collect(bool(aux_coef), tokens_BT) as router_stats:
            logps_BC, stats = completion_logprobs(
                model, mb, temperature=a.temperature, chunk_size=chunk, with_stats=True
            )
        mask_BC = loss_mask(mb)
        # An eval batch carries none: TRL's eval takes its old log-probs from the policy being
        # evaluated, so the ratio is 1.
        old_B = jnp.sum(mb["old_logps"] * mask_BC, axis=-1) if "old_logps" in mb else None
        loss_sum, aux = rloo_loss(
            logps_BC,
            mb["advantages"],
            mask_BC,
            old_logps_B=old_B,
            epsilon=a.epsilon,
            epsilon_high=a.epsilon_high,
            entropies_BT=stats["entropy"],
        )
        # TRL adds `coef x aux_loss` to the micro-batch's sequence mean, which HF's Trainer
        # then divides by the accumulation steps (eval: by nothing).
        loss_sum = router_aux.add_to_loss(
            aux_coef, router_stats, tokens_BT, mb, loss_sum, aux["sum"], aux["count"]
        )
        return loss_sum, (aux, extras)

    return loss_fn
