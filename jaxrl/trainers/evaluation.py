"""What `evaluate()` and `predict()` hand back, in HF's layout, and the host-side gathering of
per-batch predictions.

HF's `Trainer` gives `compute_metrics` an `EvalPrediction(predictions, label_ids)` whose rows are
the evaluated sequences: `predictions[:, t]` is the model output at input position `t` (so it
scores token `t + 1`) and `label_ids[:, t]` is input token `t`, or -100 where no loss is taken.
The usual recipe compares `predictions[:, :-1]` with `label_ids[:, 1:]`. jaxrl's batches carry
shifted `targets`/`loss_mask` instead (see `jaxrl.data.collate`); `label_ids_from_trained` turns
them back.

Widths follow HF's evaluation loop over TRL's collators: each device's rows are padded to their
longest (rounded up to `pad_to_multiple_of`), `pad_across_processes` fills the rest of the
batch's width with -100 (before `preprocess_logits_for_metrics`), and batches of different
widths are concatenated with -100 padding (`nested_concat(..., padding_index=-100)`). jaxrl's
batches are padded further, to a length bucket; `beyond_widths` and `trim_sequences` give them
HF's widths, so predictions do not depend on the buckets. Everything here is host numpy or a
tiny pure function; no model code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

IGNORE_INDEX = -100  # HF's label for positions without loss


class EvalPrediction:
    """What `compute_metrics` receives, as HF's `EvalPrediction`: `predictions` (the model's
    logits, or what `preprocess_logits_for_metrics` made of them on device), `label_ids`
    (unshifted, -100 where no loss is taken) and, with `include_for_metrics`, `inputs` (the
    rows' input ids) and `losses` (each eval batch's loss repeated per example); None otherwise.

    As HF's, it unpacks and indexes as `(predictions, label_ids[, inputs][, losses])`: only the
    fields that are set, so `preds, labels = pred` keeps working without `include_for_metrics`.
    """

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self.elements = (predictions, label_ids) + tuple(
            x for x in (inputs, losses) if x is not None
        )

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, idx: int) -> Any:
        # HF's bounds: 0 <= idx < number of set fields (no negative indices, no slices).
        if idx < 0 or idx >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[idx]


class PredictionOutput(NamedTuple):
    """What `trainer.predict()` returns, as HF's `PredictionOutput`."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


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


def trim_sequences(tree: Any, seq_len: int, width: int, axis: int = 1) -> Any:
    """Host arrays of one batch cut to HF's batch `width` along `axis`, for the leaves whose
    `axis` is the batch's row length `seq_len` (others, e.g. per-row scores, pass)."""

    def cut(x):
        x = np.asarray(x)
        if x.ndim < 2 or x.shape[axis] != seq_len:
            return x
        return np.take(x, np.arange(width), axis=axis)

    return jax.tree.map(cut, tree)


def _pad_rows_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`[groups, rows, ...]` blocks padded with -100 to `shape` past the rows axis."""
    grow = [(0, want - have) for want, have in zip(shape, x.shape[2:], strict=True)]
    pad = [(0, 0), (0, 0), *grow]
    if not any(after for _, after in pad):
        return x
    return np.pad(x, pad, constant_values=IGNORE_INDEX)


class PredictionGatherer:
    """Accumulates per-batch predictions and labels on the host, dropping the eval padding rows.

    A batch's outputs have `groups * b` leading rows: `groups` blocks of `b` rows, one row per
    example in each (DPO: the chosen rows, then the rejected rows). `result()` concatenates
    each block over all batches, so the final rows are block 0 of every example, then block 1;
    batches of different widths are padded with -100 to the widest, as HF's `nested_concat`.
    With `concat=False` (HF's `eval_do_concat_batches=False`) `result()` is instead the list of
    the batches' own rows (`batch_rows`), one entry per batch.
    """

    def __init__(self, groups: int = 1, concat: bool = True):
        self.groups = groups
        self.concat = concat
        self.parts: list[Any] = []

    def _blocks(self, outputs: Any, keep_B: np.ndarray) -> Any:
        def rows(x):
            x = np.asarray(x)
            return x.reshape(self.groups, -1, *x.shape[1:])[:, keep_B]

        return jax.tree.map(rows, outputs)

    def add(self, outputs: Any, keep_B: np.ndarray) -> None:
        """`outputs`: a pytree of host arrays (already gathered across processes)."""
        rows = self._blocks if self.concat else self.batch_rows
        self.parts.append(rows(outputs, keep_B))

    def batch_rows(self, outputs: Any, keep_B: np.ndarray) -> Any:
        """One batch's rows as `result()` lays them out for a single batch (padding rows
        dropped; DPO: the batch's chosen rows, then its rejected rows), without keeping them."""
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), self._blocks(outputs, keep_B))

    def result(self) -> Any:
        if not self.parts:
            return None
        if not self.concat:
            return list(self.parts)

        def concat(*xs):
            shape = tuple(np.max([x.shape[2:] for x in xs], axis=0)) if xs[0].ndim > 2 else ()
            x = np.concatenate([_pad_rows_to(x, shape) for x in xs], axis=1)
            return x.reshape(-1, *x.shape[2:])

        return jax.tree.map(concat, *self.parts)


def batch_losses_per_example(loss: float, num_examples: int) -> np.ndarray:
    """HF's `EvalPrediction.losses` rows of one eval batch: the batch's loss once per example it
    holds, float32. (HF repeats it `eval_batch_size` times and accelerate's `gather_for_metrics`
    cuts the copies of a short last batch to its examples.)"""
    return np.full(num_examples, loss, np.float32)


def prefixed(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    """HF's metric keys: `PREFIX_key`, unless the key already starts with the prefix; numpy
    scalars become Python numbers (so the metrics are JSON-serialisable)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, np.generic | np.ndarray) and np.ndim(value) == 0:
            value = value.item()
        out[key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"] = value
    return out


def speed_metrics(
    prefix: str,
    start_time: float,
    num_samples: int,
    batch_size: int,
    model_preparation_time: float | None = None,
) -> dict:
    """HF's timing keys for an evaluation or prediction pass that started at `start_time`
    (`time.time()`) and covered `num_samples` examples in batches of `batch_size`:
    `{prefix}_runtime` (s, 4 decimals), `{prefix}_samples_per_second` and
    `{prefix}_steps_per_second` (3 decimals; left out when no time has passed), and
    `{prefix}_model_preparation_time` when given (see `Trainer._prepare_for_evaluation`)."""
    runtime = time.time() - start_time
    out = {}
    if model_preparation_time is not None:
        out[f"{prefix}_model_preparation_time"] = model_preparation_time
    out[f"{prefix}_runtime"] = round(runtime, 4)
    if runtime > 0:
        steps = math.ceil(num_samples / max(batch_size, 1))
        out[f"{prefix}_samples_per_second"] = round(num_samples / runtime, 3)
        out[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)
    return out


def hf_eval_loss(batch_losses: Sequence[float], num_samples: int, batch_size: int) -> float:
    """HF's `eval_loss` from the losses of eval batches of `batch_size` examples over an eval
    dataset of `num_samples`.

    HF repeats each batch's loss `batch_size` times and averages the lot; accelerate's
    `gather_for_metrics` cuts the last batch's copies to `num_samples % batch_size` when that is
    non-zero. (For TRL's GRPO/RLOO the dataset holds prompts and a batch `batch_size`
    completions, so that remainder counts prompts.) As HF's `logging_nan_inf_filter` (default
    True), non-finite losses are left out when some are finite. NaN when there is no batch.
    """
    if not batch_losses:
        return math.nan
    weights = [batch_size] * len(batch_losses)
    if num_samples % batch_size:
        weights[-1] = num_samples % batch_size
    losses = np.repeat(np.asarray(batch_losses, np.float64), weights)
    finite = np.isfinite(losses)
    if finite.any():
        losses = losses[finite]
    return float(losses.mean())
