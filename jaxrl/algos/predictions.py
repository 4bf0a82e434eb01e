"""HF's `predict()` layout, traced: labels from the loss mask, -100 past each example's width, and
the jitted predict step that composes an algorithm's `predict(model, micro_batch)` with them.

Each algorithm that predicts per position gives `predict(model, mb) -> (logits, label_ids)`
(`jaxrl.algos.sft.predict`, `jaxrl.algos.dpo.predict`); `make_predict_step` wraps it into the
`(params, batch) -> (predictions, label_ids, input_ids, widths)` function the trainer jits
(`jaxrl.trainers.evaluation`). Host-side gathering and padding are the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100  # HF's label for positions without loss


def label_ids_from_trained(input_ids_BT: jax.Array, trained_BT: jax.Array) -> jax.Array:
    """HF labels: input token `t` where it is a trained token, else -100. Position 0 is always
    -100 (no prediction scores the first token; TRL's padding-free rows do the same)."""
    t_T = jnp.arange(input_ids_BT.shape[1])
    keep_BT = (trained_BT > 0) & (t_T >= 1)
    return jnp.where(keep_BT, input_ids_BT, IGNORE_INDEX).astype(jnp.int32)


def label_ids_from_loss_mask(input_ids_BT: jax.Array, loss_mask_BT: jax.Array) -> jax.Array:
    """HF labels of a collated row: `loss_mask[t]` marks target `t + 1`, so input token `t` is
    trained where `loss_mask[t - 1]` is set."""
    trained_BT = jnp.pad(loss_mask_BT[:, :-1], ((0, 0), (1, 0)))
    return label_ids_from_trained(input_ids_BT, trained_BT)


def beyond_widths(x_R: jax.Array, widths_B: jax.Array, axis: int) -> jax.Array:
    """`x` with the positions at or past each row's width along `axis` set to -100 (HF's
    `pad_across_processes(pad_index=-100)`). The `R` leading rows are `R // B` blocks of the
    `B` examples (DPO: chosen rows, then rejected rows); traced in the predict step."""
    widths_R = jnp.tile(widths_B, x_R.shape[0] // widths_B.shape[0])
    shape = [1] * x_R.ndim
    shape[axis] = -1
    t = jnp.arange(x_R.shape[axis]).reshape(shape)
    inside = t < widths_R.reshape((-1,) + (1,) * (x_R.ndim - 1))
    return jnp.where(inside, x_R, jnp.asarray(IGNORE_INDEX, x_R.dtype))


def make_predict_step(
    predict: Callable[[Any, dict], tuple[jax.Array, jax.Array]],
    apply_model: Callable[[Any], Any],
    input_ids: Callable[[dict], jax.Array],
    widths: Callable[[dict], jax.Array | None],
    preprocess: Callable[[jax.Array, jax.Array], Any] | None,
    per_position: bool,
) -> Callable[[Any, dict], tuple]:
    """`(params, batch_A) -> (predictions, label_ids, input_ids, widths_B)` of one eval batch
    (its single micro-batch): the algorithm's `predict`, HF's -100 past each example's `widths`
    (per position when `per_position`; the input ids always), then
    `preprocess_logits_for_metrics` on device."""

    def step(params, batch_A):
        mb = {k: v[0] for k, v in batch_A.items()}
        logits, label_ids = predict(apply_model(params), mb)
        ids = input_ids(mb)
        widths_B = widths(mb)
        if widths_B is not None:  # -100 past each device's rows, as HF pads them
            if per_position:
                logits = beyond_widths(logits, widths_B, 1)
                label_ids = beyond_widths(label_ids, widths_B, 1)
            ids = beyond_widths(ids, widths_B, ids.ndim - 1)
        if preprocess is not None:
            logits = preprocess(logits, label_ids)
        return logits, label_ids, ids, widths_B

    return step
