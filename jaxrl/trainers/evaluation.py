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
HF's widths, so predictions do not depend on the buckets. The functions and classes here are
host numpy or tiny pure functions.

`EvaluationMixin` is `jaxrl.trainers.base.Trainer`'s `evaluate()` and `predict()`: fixed-order
eval batches, the jitted eval and predict steps run over them and HF's metric and prediction
layout made of their outputs. The loss and the predictions are the trainer's (`_loss_fn`,
`_prediction_fn`); no model code here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl import parallel
from jaxrl.algos.predictions import IGNORE_INDEX, make_predict_step
from jaxrl.data.collate import trl_example_widths

logger = logging.getLogger("jaxrl")



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


class EvaluationMixin:
    """`Trainer`'s `evaluate()` / `predict()` (subclass hooks: `_prediction_fn`,
    `_prediction_input_ids`, `_prediction_groups`, `_predictions_per_position`,
    `_before_evaluation`, `_models_prepared_at_init`, `_eval_batches`, `_hf_widths`)."""

    def _prediction_fn(self) -> Callable | None:
        """`(model, micro_batch) -> (logits, label_ids)` of one eval batch in HF's layout (see
        the module docstring); traced inside the jitted predict step. None: no predictions."""
        return None

    # Rows of predictions per example: DPO predicts a chosen and a rejected row per pair.
    _prediction_groups = 1
    # Whether predictions and labels are per position `[rows, T, ...]` (SFT, DPO), so that
    # they take HF's per-batch widths; reward predictions are per pair.
    _predictions_per_position = True

    def _prediction_input_ids(self, mb: dict) -> jax.Array:
        """The input ids of an eval micro-batch's prediction rows, as `_prediction_fn` lays its
        rows out (`EvalPrediction.inputs` with `include_for_metrics=["inputs"]`): by default the
        batch's `input_ids` (SFT `[B, T]`, reward `[B, 2, T]` pairs). Traced in the predict step."""
        return mb["input_ids"]

    def _prepare_for_evaluation(self) -> None:
        """`_ensure_state` for `evaluate()` / `predict()`. HF: when they run before any training,
        they prepare the model themselves, and that time (here: building the sharded state and
        compiling the steps) is `{prefix}_model_preparation_time` (s, 4 decimals) in their
        metrics from then on, left out of `{prefix}_runtime`."""
        if self.train_state is None:
            start = time.time()
            self._ensure_state()
            if not self._models_prepared_at_init():
                self.model_preparation_time = round(time.time() - start, 4)

    def _models_prepared_at_init(self) -> bool:
        """Whether TRL's trainer hands a model (a reference, a reward model) to accelerate in its
        constructor: then HF's evaluation finds accelerate already holding models and reports no
        `model_preparation_time`."""
        return False

    def _eval_batches(self, dataset):
        """Fixed-order eval batches, each padded to its own bucket (`_batch_seq_len`); the last
        one is filled with weight-0 copies."""
        bs = self.args.per_device_eval_batch_size * self.dp
        n = len(dataset)
        per_host = bs // jax.process_count()
        for start in range(0, n, bs):
            idx = [min(start + i, n - 1) for i in range(bs)]
            real = [start + i < n for i in range(bs)]
            lo = jax.process_index() * per_host
            rows = [dataset[i] for i in idx[lo : lo + per_host]]
            batch = self._collate(rows, self._batch_seq_len(dataset, idx, "eval"))
            batch["example_mask"] = np.asarray(real[lo : lo + per_host], np.float32)
            yield {k: v[None] for k, v in batch.items()}

    def _before_evaluation(self, dataset: Any) -> None:
        """Host-side work an algorithm does at each evaluation before the metric pass (DPO's
        `generate_during_eval`); none by default."""

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict:
        """Eval loss and metrics over `eval_dataset` (default: the trainer's), logged and
        returned with keys `{metric_key_prefix}_*` (HF). With `compute_metrics`, it also gets
        the gathered predictions (HF's layout; `preprocess_logits_for_metrics` runs on device),
        or each batch's with `batch_eval_metrics` (see `_evaluation_loop`)."""
        self._prepare_for_evaluation()
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._admit(self._prepare_dataset(eval_dataset, "eval"))
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        self._before_evaluation(ds)
        want = self.compute_metrics is not None and not self.args.prediction_loss_only
        metrics, _ = self._evaluation_loop(ds, metric_key_prefix, ignore_keys, want)
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """HF's `predict`: predictions and labels over `test_dataset` (raw rows, a path or hub id,
        or already tokenized), with the eval metrics (and `compute_metrics`') under
        `{metric_key_prefix}_*`. Predictions per trainer: SFT, the logits `[N, T, V]` (or the
        output of `preprocess_logits_for_metrics`); DPO, those of the `prompt + chosen` rows then
        the `prompt + rejected` rows `[2N, ...]`; reward, the `[N, 2]` (chosen, rejected) scores
        with label 0 (the chosen column). `T` and the -100 padding are HF's: each eval batch as
        wide as TRL pads its devices' rows, the narrower batches padded to the widest with -100
        (`jaxrl.trainers.evaluation`), whatever `length_buckets`. Not logged; callbacks get
        `on_predict`."""
        self._prepare_for_evaluation()
        ds = self._admit(self._prepare_dataset(test_dataset, "test"))
        want = not self.args.prediction_loss_only  # HF: then no predictions, no labels
        metrics, (preds, labels) = self._evaluation_loop(
            ds, metric_key_prefix, ignore_keys, want, predicting=True
        )
        self._event("on_predict", metrics=metrics)
        return PredictionOutput(preds, labels, metrics)

    def _admit(self, ds: Any) -> Any:
        """A dataset given to `evaluate`/`predict` after the steps were compiled: where the LM
        head runs on a `score_span` (SFT, DPO) too short for it, the span widens and the steps
        are compiled again."""
        if self.score_span is not None and ds is not None:
            needed = self._score_span([ds])
            if needed is None or needed > self.score_span:
                self.score_span = needed
                self._compile(self.train_state)
        return ds

    def _evaluation_loop(
        self,
        ds: Any,
        prefix: str,
        ignore_keys: list[str] | None,
        want_predictions: bool,
        predicting: bool = False,
    ) -> tuple[dict, tuple[Any, Any]]:
        """Eval metrics (prefixed) and, when asked for and the trainer has them, the predictions
        and labels of every example in order (gathered across processes on every host).

        Averaged as HF and TRL do: each metric's value is taken per eval batch
        (`per_device_eval_batch_size` x data-parallel devices; the last one holds the remaining
        examples), then the loss is averaged over the batches weighted by their example counts,
        non-finite ones left out (HF's `eval_loss`, `hf_eval_loss`) and every other metric, a
        batch's min and max included, is the plain mean of the batch values (TRL's `log()`).
        `num_tokens` is the training tokens seen so far, as TRL logs it at evaluation. HF's
        `{prefix}_runtime`, `_samples_per_second` and `_steps_per_second` are added.

        `compute_metrics` as HF's `evaluation_loop` calls it: once on everything gathered, or,
        with `batch_eval_metrics`, on each batch's rows with `compute_result=False` and on the
        last batch's with `compute_result=True`, the last call's return value being the
        metrics (evaluate() then keeps no predictions; predict() still returns them).
        `include_for_metrics` adds `inputs` and/or `losses` to its `EvalPrediction`. Each
        batch's outputs reach the host as soon as it is done (HF's `eval_accumulation_steps=1`),
        so nothing accumulates on the accelerator."""
        start = time.time()
        a = self.args
        batch_values: dict[str, list[float]] = {}
        batch_losses: list[float] = []
        seen_totals: set[str] = set()
        # HF drops model outputs named in ignore_keys; the only output here is `logits`.
        want_predictions = want_predictions and "logits" not in (ignore_keys or [])
        predict = self._jitted_predict() if want_predictions else None
        per_batch = a.batch_eval_metrics and self.compute_metrics is not None
        keep_all = not per_batch or predicting  # HF: batch_eval_metrics keeps them for predict()
        want_inputs = "inputs" in a.include_for_metrics
        want_losses = "loss" in a.include_for_metrics
        groups = self._prediction_groups
        concat = a.eval_do_concat_batches
        preds, labels, inputs = (PredictionGatherer(groups, concat) for _ in range(3))
        example_losses: list[np.ndarray] = []
        bs = a.per_device_eval_batch_size * self.dp
        n_batches = -(-len(ds) // bs)
        batch_metrics = None
        for step, host in enumerate(self._eval_batches(ds)):
            batch = self._to_device(host)
            aux = jax.device_get(self._jit_eval_step(self.train_state, batch))
            values = {}
            for k, v in aux.get("sum", {}).items():
                count = float(np.sum(aux["count"][k]))
                if count == 0 and k in self._nan_allowed_metrics:
                    continue  # no row of this batch has it (KTO's per-label metrics): as TRL
                values[k] = float(np.sum(v)) / max(count, 1.0)
            values.update({k: float(np.nanmin(v)) for k, v in aux.get("min", {}).items()})
            values.update({k: float(np.nanmax(v)) for k, v in aux.get("max", {}).items()})
            seen_totals.update(aux.get("total", {}))
            for k, v in values.items():
                if k == self._loss_metric:
                    batch_losses.append(v)
                else:
                    batch_values.setdefault(k, []).append(v)
            if predict is None:
                continue
            p, lab, ids, widths = predict(self.current_params(), batch)
            p, lab, widths = parallel.to_host((p, lab, widths))
            ids = parallel.to_host(ids) if want_inputs else None
            keep = parallel.to_host(batch["example_mask"])[0] > 0
            if widths is not None:  # HF's batch width: its widest device's rows
                t, width = host["input_ids"].shape[-1], int(widths[keep].max())
                if self._predictions_per_position:
                    p, lab = trim_sequences((p, lab), t, width)
                ids = None if ids is None else trim_sequences(ids, t, width, axis=-1)
            losses = None
            if want_losses and self._loss_metric in values:
                losses = batch_losses_per_example(values[self._loss_metric], int(keep.sum()))
            if keep_all:
                preds.add(p, keep)
                labels.add(lab, keep)
            if per_batch:
                one = PredictionGatherer(groups)
                batch_metrics = self.compute_metrics(
                    EvalPrediction(
                        one.batch_rows(p, keep),
                        one.batch_rows(lab, keep),
                        inputs=None if ids is None else one.batch_rows(ids, keep),
                        losses=losses,
                    ),
                    compute_result=step == n_batches - 1,
                )
                continue
            if ids is not None:  # for the one compute_metrics call after the loop
                inputs.add(ids, keep)
            if losses is not None:
                example_losses.append(losses)
        metrics = {}
        if batch_losses:
            metrics[self._loss_metric] = hf_eval_loss(batch_losses, len(ds), bs)
        metrics.update({k: float(np.mean(v)) for k, v in batch_values.items()})
        if "num_tokens" in seen_totals:
            metrics["num_tokens"] = float(getattr(self, "_tokens_seen", 0))
        all_preds, all_labels = preds.result(), labels.result()
        if per_batch:
            metrics.update(batch_metrics or {})
        elif self.compute_metrics is not None and all_preds is not None:
            pred = EvalPrediction(
                all_preds,
                all_labels,
                inputs=inputs.result() if want_inputs else None,
                losses=(np.concatenate(example_losses) if concat else example_losses)
                if example_losses
                else None,
            )
            metrics.update(self.compute_metrics(pred))
        metrics = prefixed(metrics, prefix)
        prep = getattr(self, "model_preparation_time", None)
        metrics.update(speed_metrics(prefix, start, len(ds), bs, prep))
        return metrics, (all_preds, all_labels)

    def _hf_widths(self, mb: dict) -> jax.Array | None:
        """Per example of an eval micro-batch `[B]`: the width HF's evaluation gives its rows
        (its device's longest row, rounded up to `pad_to_multiple_of`); None for best-fit packed
        rows, which keep the static length."""
        if "segment_ids" in mb:
            return None
        a = self.args
        return trl_example_widths(
            mb, mb["example_mask"], a.per_device_eval_batch_size, a.pad_to_multiple_of
        )

    def _jitted_predict(self) -> Callable | None:
        """The jitted `(params, batch) -> (predictions, label_ids, input_ids, widths)` (built
        once), or None; `input_ids` are in the predictions' row layout (`_prediction_input_ids`),
        `widths` HF's per example (`_hf_widths`), past which the rest are -100."""
        if self._jit_predict is None:
            fn = self._prediction_fn()
            if fn is None:
                return None
            input_ids = self._prediction_input_ids
            preprocess = self.preprocess_logits_for_metrics
            if preprocess is None and self.model_task == "causal_lm":
                logger.warning(
                    "%s hands compute_metrics/predict the full logits [N, T, vocab] on the host, "
                    "as HF does; pass preprocess_logits_for_metrics (e.g. an argmax) to reduce "
                    "them on device.",
                    type(self).__name__,
                )

            predict = make_predict_step(
                fn,
                self.apply_model,
                input_ids,
                self._hf_widths,
                preprocess,
                self._predictions_per_position,
            )
            self._jit_predict = jax.jit(predict)
        return self._jit_predict
