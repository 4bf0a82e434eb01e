"""The traced math of Bradley-Terry reward modelling (TRL `RewardTrainer`): the pairs' scores
and the loss factory the generic step differentiates.

Chosen and rejected rows go through one forward of a sequence-classification model, scored at
each row's last real token; the loss is `-log_sigmoid(r_c - r_r - margin)`
(+ `center_rewards_coefficient * (r_c + r_r)^2`, `jaxrl.losses.reward`). Metrics use TRL's
names (`accuracy`, `margin`, `min_reward`, `mean_reward`, `max_reward`, `num_tokens`). Nothing
here reads datasets, collates or touches the host loop (`jaxrl.trainers.reward` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.algos.masks import model_masks
from jaxrl.losses.reward import reward_loss
from jaxrl.models.heads import score_mask


def pair_scores(model, mb: dict, pad_token_id: int | None = None) -> tuple[dict, jax.Array]:
    """The pairs' rows `[2B, T]` (chosen rows, then rejected rows) and their f32 scores `[2B]`,
    read at each row's last real token that is not `pad_token_id` (`score_mask`, as TRL's model
    reads it with `config.pad_token_id` set to the tokenizer's pad; None: the mask alone)."""
    rows = {
        k: jnp.concatenate([v[:, 0], v[:, 1]], axis=0)
        for k, v in mb.items()
        if v.ndim >= 3 or k in ("input_ids", "attention_mask")
    }
    # Right-padded single-document rows run unmasked (`model_masks`); the score is still read
    # at each row's last real token.
    attention_mask, segment_ids = model_masks(rows)
    h_2BTD = model.hidden_states(rows["input_ids"], attention_mask, rows["positions"], segment_ids)
    mask_2BT = score_mask(rows["input_ids"], rows["attention_mask"], pad_token_id)
    scores_2B = model.last_token_scores(h_2BTD, mask_2BT)[:, 0]
    return rows, scores_2B.astype(jnp.float32)


def pair_predictions(model, mb: dict, pad_token_id: int | None) -> tuple[jax.Array, jax.Array]:
    """HF eval predictions of a pair batch: `[B, 2]` (chosen, rejected) scores and `[B]` labels,
    all 0: label 0 names the preferred column, so `argmax(predictions, 1) == label_ids` is the
    pair accuracy (TRL's old `compute_accuracy` layout)."""
    _, scores_2B = pair_scores(model, mb, pad_token_id)
    b = scores_2B.shape[0] // 2
    scores_B2 = jnp.stack([scores_2B[:b], scores_2B[b:]], axis=1)
    return scores_B2, jnp.zeros((b,), jnp.int32)


def make_loss(
    config: Any, apply_model: Callable[[Any, Any], Any], *, pad_token_id: int | None
) -> Callable:
    """The reward loss `loss_fn(params, state, mb, rng, extras) -> (loss_sum, (aux, extras))`
    of `jaxrl.core.step` (per pair) from a `RewardConfig`'s `center_rewards_coefficient`;
    `apply_model(params, state)` is the scorer bound to `params`, `pad_token_id` as in
    `pair_scores`."""
    coef = config.center_rewards_coefficient
    pad_id = pad_token_id

    def loss_fn(params, state, mb, rng, extras):
        rows, scores_2B = pair_scores(apply_model(params, state), mb, pad_id)
        b = scores_2B.shape[0] // 2
        rc_B, rr_B = scores_2B[:b], scores_2B[b:]
        losses_B = reward_loss(rc_B, rr_B, margin_B=mb["margin"], center_rewards_coefficient=coef)
        w_B = mb["example_mask"] if "example_mask" in mb else jnp.ones_like(losses_B)
        n = jnp.sum(w_B)
        loss_sum = jnp.sum(losses_B * w_B)
        both_w = jnp.concatenate([w_B, w_B])
        big = jnp.finfo(jnp.float32).max
        aux = {
            "sum": {
                "loss": loss_sum,
                "accuracy": jnp.sum((rc_B > rr_B) * w_B),
                "margin": jnp.sum((rc_B - rr_B) * w_B),
                "mean_reward": jnp.sum(scores_2B * both_w),
            },
            "count": {"loss": n, "accuracy": n, "margin": n, "mean_reward": 2 * n},
            "min": {"min_reward": jnp.min(jnp.where(both_w > 0, scores_2B, big))},
            "max": {"max_reward": jnp.max(jnp.where(both_w > 0, scores_2B, -big))},
            "total": {
                "num_tokens": jnp.sum(rows["attention_mask"] * both_w[:, None]).astype(jnp.float32)
            },
        }
        return loss_sum, (aux, extras)

    return loss_fn
