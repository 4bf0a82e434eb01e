"""How long a trainer's rows are: the run's static row length (`seq_len`) and its length
buckets, the bucket of each batch, the per-example lengths behind them and behind
`train_sampling_strategy="group_by_length"`, and HF's `num_input_tokens_seen` count of a step.

`LengthsMixin` is one of the pieces `jaxrl.trainers.base.Trainer` is composed of; the
arithmetic on lengths is `jaxrl.data.collate`'s. Host-side numbers only: no collation, no model.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.data import collate

logger = logging.getLogger("jaxrl")


class LengthsMixin:
    """`Trainer`'s row lengths and token counts (subclass hooks: `_fills_static_length`,
    `_max_length`, `_batch_seq_len`, `_trl_device_rows`; `_example_lengths` is `Trainer`'s)."""

    def _choose_seq_len(self) -> int:
        lengths: list[int] = []
        for ds in (self.train_dataset, self.eval_dataset):
            if ds is not None:
                lengths.extend(self._lengths_of(ds).tolist())
        if not lengths:
            return self.args.max_length or 1024
        return collate.choose_seq_len(
            lengths, self._max_length(), multiple_of=self.args.pad_to_multiple_of or 1
        )

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """The row lengths a batch may be padded to, ascending, the last being the run's static
        `seq_len` (config `length_buckets`; just `seq_len` for trainers without that field)."""
        spec = getattr(self.args, "length_buckets", None)
        return collate.length_buckets(self.seq_len, spec, self.args.pad_to_multiple_of)

    def _lengths_of(self, dataset: Any) -> np.ndarray:
        """`_example_lengths(dataset)` as an array, computed once per dataset object (the few
        most recent are kept: the train and eval sets, and one passed to evaluate/predict)."""
        for ds, lengths in self._lengths_cache:
            if ds is dataset:
                return lengths
        lengths = np.asarray(self._example_lengths(dataset), np.int64)
        self._lengths_cache = [*self._lengths_cache[-3:], (dataset, lengths)]
        return lengths

    def _batch_seq_len(self, dataset: Any, indices: Any, split: str) -> int:
        """The row length of a batch of `dataset[indices]` (all of a step's micro-batches, on
        every host): the smallest of `length_buckets` holding its longest example, or the static
        length for rows made to fill it (`_fills_static_length`)."""
        buckets = self.length_buckets
        if len(buckets) == 1 or self._fills_static_length(split) or len(indices) == 0:
            return self.seq_len
        longest = int(self._lengths_of(dataset)[np.asarray(indices)].max())
        return collate.bucket_length(longest, buckets)

    def _fills_static_length(self, split: str) -> bool:
        """Whether the rows of a `split` ("train" or "eval") dataset are built to the static
        length (SFT packing), so bucketing them would only add compiled shapes."""
        return False

    def _max_length(self) -> int | None:
        """The cap on the run's static row length: `max_length`, where None means no cap (TRL
        then truncates nothing, so the longest example sets the length)."""
        return getattr(self.args, "max_length", None)

    def _group_lengths(self, raw: Any) -> list[int] | None:
        """Per training row, the lengths `train_sampling_strategy="group_by_length"` sorts by
        (None for the other strategies), as HF's Trainer finds them: the dataset's
        `length_column_name` column, else the length of each row's `input_ids`. The column is
        read from the dataset as given, so it is used while the prepared rows are its examples one
        to one (SFT packing makes new rows; dropped examples leave no way to match them)."""
        a = self.args
        if a.train_sampling_strategy != "group_by_length" or self.train_dataset is None:
            return None
        column = a.length_column_name
        prepared = self.train_dataset
        unusable = None  # why the dataset's length column cannot be used
        if column in (getattr(raw, "column_names", None) or []):
            if getattr(a, "packing", False):
                unusable = "packing makes new rows"
            elif len(raw) != len(prepared):
                unusable = f"{len(raw) - len(prepared)} examples were dropped in preparation"
            else:
                return [int(n) for n in raw[column]]
        if "input_ids" in prepared.column_names:
            if unusable is not None:
                logger.warning(
                    "train_sampling_strategy='group_by_length': the %r column does not describe "
                    "the training rows (%s), so their input_ids lengths are used instead.",
                    column,
                    unusable,
                )
            return [len(ids) for ids in prepared["input_ids"]]
        if unusable is not None:
            raise ValueError(
                f"train_sampling_strategy='group_by_length': the train dataset's {column!r} column "
                f"does not describe the training rows ({unusable}); remove those examples from "
                "the dataset first, or use train_sampling_strategy='random'."
            )
        raise ValueError(
            "train_sampling_strategy='group_by_length' needs each training example's length: HF "
            f"reads the dataset's {column!r} column (`length_column_name`) or infers it from an "
            f"'input_ids' column, and {type(self).__name__}'s rows have neither. Add a "
            f"{column!r} column to the train dataset, or use train_sampling_strategy='random'."
        )

    def _trl_device_rows(self) -> int:
        """How many consecutive rows of a train micro-batch TRL's collator gets as one device's
        share: `per_device_train_batch_size` (SFT's padding-free rows: 1, each row a device's)."""
        return self.args.per_device_train_batch_size

    def _input_tokens(self, host_A: dict[str, np.ndarray]) -> Any:
        """HF's `num_input_tokens_seen` increment of one step, counted on the host's collated
        micro-batches as TRL collates them (`collate.trl_input_tokens`), summed over hosts."""
        a = self.args
        count = sum(
            collate.trl_input_tokens(
                {k: v[i] for k, v in host_A.items()},
                host_A["example_mask"][i],
                mode=a.include_num_input_tokens_seen,
                pad_token_id=self.tokenizer.pad_token_id,
                per_device=self._trl_device_rows(),
                multiple_of=a.pad_to_multiple_of,
            )
            for i in range(host_A["example_mask"].shape[0])
        )
        if jax.process_count() == 1:
            return count
        # Each host counted its own rows: a sum over a global array, read one step late.
        per_row = np.zeros(host_A["example_mask"].shape[:2], np.int32)
        per_row[0, 0] = count
        return jnp.sum(self._to_device({"n": per_row})["n"])
