"""SFTTrainer: supervised fine-tuning with TRL `SFTTrainer` semantics on the generic step.

The loss is token-weighted NLL over `loss_mask` tokens (completion-only / assistant-only masks
come from the data layer), computed from hidden states with chunked log-probs so no full f32
[B, T, V] exists; its traced math is `jaxrl.algos.sft`, this file the host shell around it.
Logged metrics use TRL's names: `loss`, `mean_token_accuracy`, `entropy`, `num_tokens`,
`grad_norm`, `learning_rate`.

`padding_free=True` (TRL's) collates each device's share of a micro-batch as one row of its
examples back to back (`collate.collate_padding_free`), padded to a bucket of such rows'
lengths; the numbers are the padded layout's, `num_tokens` and `num_input_tokens_seen` count
the rows as TRL's collator makes them, and predictions come one row per device (HF's layout).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import datasets
import jax
import numpy as np

from jaxrl.algos import sft as sft_algo
from jaxrl.data import vision
from jaxrl.data.collate import (
    bucket_length,
    collate_padding_free,
    collate_sft,
    padding_free_buckets,
    padding_free_longest_row,
)
from jaxrl.data.formats import require_columns
from jaxrl.data.sft import prepare_sft_dataset, rows_as_given
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.image_text import ImageTextMixin
from jaxrl.trainers.sft_config import SFTConfig

logger = logging.getLogger(__name__)


def trained_width(mask_rows: Any) -> int:
    """The widest stretch, first to last trained (nonzero) token inclusive, of any row of
    per-token masks (lists of a dataset's rows, or a collated `[rows, T]` array; 0 when none is
    trained)."""
    widest = 0
    for row in mask_rows:
        trained = np.flatnonzero(np.asarray(row))
        if trained.size:
            widest = max(widest, int(trained[-1] - trained[0]) + 1)
    return widest


def choose_score_span(width: int, seq_len: int) -> int | None:
    """`jaxrl.algos.sft.lm_forward`'s `score_span` for rows whose scored targets lie within
    `width` positions: `width` rounded up to a multiple of 8, or None when that would not be
    shorter than a row."""
    span = -(-max(width, 1) // 8) * 8
    return span if span < seq_len else None


def check_score_span(loss_mask: np.ndarray, span: int | None) -> None:
    """Host-side guard of a collated `[rows, T]` batch: every row's scored targets fit `span`."""
    if span is None:
        return
    widest = trained_width(loss_mask > 0)
    if widest > span:
        raise ValueError(
            f"A row's scored tokens span {widest} positions but the LM head runs on {span} "
            "(`score_span`, from the widest completion of the train and eval sets); set "
            "trainer.score_span = None or collate only examples of those datasets."
        )


class SFTTrainer(ImageTextMixin, Trainer):
    """Supervised fine-tuning (TRL `SFTTrainer` API; `args` is an `SFTConfig`)."""

    config_class = SFTConfig
    _name = "SFT"
    _tag_names = ("trl", "sft")

    def __init__(self, model: Any, args: SFTConfig | None = None, *a, formatting_func=None, **kw):
        self.formatting_func = formatting_func
        # TRL's vision datasets (an `image` / `images` column): the model runs its vision tower,
        # the processor runs in the collator (`jaxrl.data.vision`).
        a, kw = list(a), dict(kw)
        if a:
            a[0] = self._load_data(a[0], "train")
            train = a[0]
        else:
            train = kw["train_dataset"] = self._load_data(kw.get("train_dataset"), "train")
        self.vision = vision.image_column(getattr(train, "column_names", None)) is not None
        self._vision_collator: vision.VisionCollator | None = None
        # Row lengths of the prepared image datasets, by `id` of the (kept) dataset object.
        self._vision_lengths: dict[int, list[int]] = {}
        # The model generation config's EOS ids once `args.eos_token` has been put first, or
        # the one EOS id of a tokenizer whose chat template was cloned (None: unchanged).
        self._generation_eos_ids: list[int] | int | None = None
        if args is not None and args.padding_free:
            self._check_padding_free(args)
        super().__init__(model, args, *a, **kw)
        # Completion-only / assistant-only losses score part of each row: the LM head runs on
        # the widest trained stretch of the data only (`lm_forward`'s `score_span`).
        self.score_span = self._score_span([self.train_dataset, self.eval_dataset])

    def _check_padding_free(self, a: SFTConfig) -> None:
        """TRL 1.16's checks and warnings for `padding_free=True` (vision datasets refuse it in
        `_refuse_vision_options`)."""
        if self.vision:
            return
        if not a.packing and a.max_length is not None:
            raise ValueError(
                "When `padding_free=True` without packing, `max_length` is not enforced (TRL "
                "refuses this too): set `max_length=None` (truncate the data yourself if "
                "needed), or enable packing (`packing=True, packing_strategy='bfd'`, which is "
                "padding-free already)."
            )
        if a.packing and a.packing_strategy == "wrapped":
            logger.warning(
                "padding_free=True with packing_strategy='wrapped' is not recommended (TRL warns "
                "too): wrapped rows already fill max_length, cut mid-document, and flattening "
                "them changes nothing; use packing_strategy='bfd'."
            )
        if a.per_device_train_batch_size == 1 and not a.packing:
            logger.warning(
                "padding_free=True with per_device_train_batch_size=1 flattens one example per "
                "row, which saves nothing; use a per-device batch of at least 2."
            )

    def _padding_free(self, split: str) -> bool:
        """Whether a `split` ("train" or "eval") batch is collated padding-free
        (`collate_padding_free`): TRL's `padding_free` (set, or implied by best-fit packing)
        on rows that are not packed. Packed rows are padding-free already (`segment_ids`)."""
        a = self.args
        trl_padding_free = a.padding_free or (
            a.packing and a.packing_strategy in ("bfd", "bfd_split")
        )
        return trl_padding_free and not self.vision and not self._fills_static_length(split)

    def _per_device(self, split: str) -> int:
        a = self.args
        return a.per_device_train_batch_size if split == "train" else a.per_device_eval_batch_size

    def _padding_free_buckets(self, split: str) -> tuple[int, ...]:
        """Row lengths of a split's padding-free batches: up to `per_device` x the longest
        example (`seq_len`), `length_buckets` read as lengths of flattened rows."""
        a = self.args
        static = self._per_device(split) * self.seq_len
        return padding_free_buckets(static, a.length_buckets, a.pad_to_multiple_of)

    def _padding_free_len(self, dataset: Any, idx_by_host: list, split: str) -> int:
        """The row length of a padding-free batch whose hosts hold `dataset[idx_by_host[p]]`:
        the smallest bucket holding its longest device row (the same on every host)."""
        lengths = self._lengths_of(dataset)
        longest = padding_free_longest_row(
            [lengths[np.asarray(idx, np.int64)] for idx in idx_by_host], self._per_device(split)
        )
        return bucket_length(longest, self._padding_free_buckets(split))

    def _batch_seq_len(self, dataset: Any, indices: Any, split: str) -> int:
        if not self._padding_free(split):
            return super()._batch_seq_len(dataset, indices, split)
        # Each host's contiguous share of the global batch (`BatchIterator.host_share`).
        shares = np.array_split(np.asarray(indices, np.int64), jax.process_count())
        return self._padding_free_len(dataset, shares, split)

    def _collate_micro(
        self,
        examples: list[dict],
        accum: int,
        real: int | None = None,
        seq_len: int | None = None,
    ) -> dict[str, np.ndarray]:
        if not self._padding_free("train"):
            return super()._collate_micro(examples, accum, real, seq_len)
        # One row per local device and micro-batch; the copies filling an epoch's short last
        # batch are left out (rows run short or empty), as HF's shorter last batch.
        n = len(examples)
        if n % accum:
            raise ValueError(f"{n} examples do not split into {accum} micro-batches.")
        m, per_device = n // accum, self.args.per_device_train_batch_size
        real = n if real is None else real
        seq_len = seq_len or self._padding_free_buckets("train")[-1]
        micro = [
            collate_padding_free(
                examples[i * m : min((i + 1) * m, real)],
                per_device,
                m // per_device,
                seq_len,
                self.tokenizer.pad_token_id,
            )
            for i in range(accum)
        ]
        return {k: np.stack([mb[k] for mb in micro]) for k in micro[0]}

    def _eval_batches(self, dataset):
        if not self._padding_free("eval"):
            yield from super()._eval_batches(dataset)
            return
        per_device = self.args.per_device_eval_batch_size
        bs, n, hosts = per_device * self.dp, len(dataset), jax.process_count()
        per_host = bs // hosts
        for start in range(0, n, bs):
            shares = [
                np.arange(start + p * per_host, min(start + (p + 1) * per_host, n))
                for p in range(hosts)
            ]
            seq_len = self._padding_free_len(dataset, shares, "eval")
            mine = [dataset[int(i)] for i in shares[jax.process_index()]]
            batch = collate_padding_free(
                mine, per_device, per_host // per_device, seq_len, self.tokenizer.pad_token_id
            )
            yield {k: v[None] for k, v in batch.items()}

    def _trl_device_rows(self) -> int:
        return 1 if self._padding_free("train") else super()._trl_device_rows()

    def _hf_widths(self, mb: dict) -> jax.Array | None:
        if not self._padding_free("eval"):
            return super()._hf_widths(mb)
        return sft_algo.padding_free_widths(mb, self.args.pad_to_multiple_of)

    def _apply_eos_token(self, tokenizer: Any) -> None:
        """The base's `eos_token` handling, and for a model that generates, the new EOS id goes
        first among the model generation config's EOS ids, ahead of the ones it had (TRL)."""
        old_ids = self._model_generation_eos_ids()  # read before the model config changes
        super()._apply_eos_token(tokenizer)
        new_id = int(tokenizer.eos_token_id)
        if new_id not in old_ids:  # else TRL leaves the generation config as it is
            self._generation_eos_ids = [new_id, *old_ids]

    def _clone_chat_template(self, processing_class: Any, path: str) -> None:
        """The base's cloning; the model's generation config then stops at the cloned EOS
        alone (TRL's `clone_chat_template` sets `generation_config.eos_token_id` to it)."""
        super()._clone_chat_template(processing_class, path)
        self._generation_eos_ids = int(processing_class.eos_token_id)

    def _model_generation_eos_ids(self) -> list[int]:
        """`eos_token_id` of the model's generation config as transformers loads it: the model
        directory's `generation_config.json`, else derived from the model config (none for a
        user-built model without an HF config)."""
        from transformers import GenerationConfig as HFGenerationConfig

        gen = None
        if self.model_path is not None:
            try:
                gen = HFGenerationConfig.from_pretrained(self.model_path, local_files_only=True)
            except OSError:
                gen = None  # no generation_config.json: derived from the config, as below
        if gen is None:
            hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
            if hf_config is not None:
                gen = HFGenerationConfig.from_model_config(hf_config)
        ids = getattr(gen, "eos_token_id", None)
        ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
        return [int(i) for i in ids]

    def generation_config(self, generation_config: Any = None, **overrides: Any):
        # The model's own generation config (generation_config=None) stops at `eos_token` too.
        ids = self._generation_eos_ids
        if generation_config is None and ids is not None:
            overrides.setdefault("eos_token_id", ids if isinstance(ids, int) else tuple(ids))
        return super().generation_config(generation_config, **overrides)

    def _export_generation_config(self, out: str) -> Any:
        config = super()._export_generation_config(out)
        ids = self._generation_eos_ids
        if ids is not None:
            config.eos_token_id = ids if isinstance(ids, int) else list(ids)
        return config

    def _score_span(self, sources: list) -> int | None:
        if self.vision:  # rows are processed in the collator: every position is scored
            return None
        if self._padding_free("train") or self._padding_free("eval"):  # rows of many examples
            return None
        widths = [trained_width(ds["loss_mask"]) for ds in sources if ds is not None]
        return choose_score_span(max(widths, default=self.seq_len), self.seq_len)

    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        a = self.args
        dataset = self._load_data(dataset, split)
        if self.vision:
            return self._prepare_vision_dataset(dataset, split)
        if vision.image_column(dataset.column_names) is not None:
            raise ValueError(
                f"The {split} dataset has images but the train dataset has none; give both "
                "images, or neither."
            )
        if a.skip_prepare_dataset:
            return rows_as_given(dataset, a.dataset_num_proc)
        return prepare_sft_dataset(
            dataset,
            self.tokenizer,
            dataset_text_field=a.dataset_text_field,
            max_length=a.max_length,
            formatting_func=self.formatting_func,
            completion_only_loss=a.completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            # TRL: `eval_packing` (None: as `packing`) for every dataset but the training one.
            packing=a.packing if split == "train" or a.eval_packing is None else a.eval_packing,
            packing_strategy=a.packing_strategy,
            eos_token=a.eos_token,
            num_proc=a.dataset_num_proc,
            truncation_mode=a.truncation_mode,
            shuffle_seed=a.seed if a.shuffle_dataset else None,
        )

    def _example_lengths(self, dataset: datasets.Dataset) -> list[int]:
        if self.vision:
            return self._vision_lengths[id(dataset)]
        return [len(x) for x in dataset["input_ids"]]

    # ----------------------------------------------------------------- image-text data
    def _refuse_vision_options(self, kind: str) -> None:
        """TRL's refusals for vision datasets, and the options jaxrl's image-text path does not
        run (an error rather than an ignored option)."""
        a = self.args
        refusals = {
            "packing=True": a.packing or bool(a.eval_packing),
            "truncation_mode='keep_end'": a.truncation_mode == "keep_end",
            "a formatting_func": self.formatting_func is not None,
            "shuffle_dataset=True": a.shuffle_dataset,
            "dataset_kwargs={'skip_prepare_dataset': True}": a.skip_prepare_dataset,
            "padding_free=True": a.padding_free,
            "assistant_only_loss=True on data without 'messages'": (
                a.assistant_only_loss and kind != "messages"
            ),
            "completion_only_loss=True on language-modelling data": (
                a.completion_only_loss is True and kind != "prompt_completion"
            ),
        }
        for option, set_ in refusals.items():
            if set_:
                raise ValueError(
                    f"{option} is not supported for datasets with images (TRL refuses packing, "
                    "padding-free batches, keep_end truncation, completion_only_loss on language modelling and "
                    "assistant_only_loss without conversational language-modelling data, and "
                    "skips the dataset preparation where formatting_func and shuffle_dataset "
                    "act). Unset it or drop the image column."
                )

    def _prepare_vision_dataset(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        """Vision rows stay as given (the collator processes them, as TRL's); their row lengths
        and image counts are read here, without processing any image."""
        a = self.args
        columns = dataset.column_names
        if vision.image_column(columns) is None:
            raise ValueError(
                f"The train dataset has images but the {split} dataset has none; give both "
                "images, or neither."
            )
        found = require_columns(
            columns,
            [("messages",), (a.dataset_text_field,), ("prompt", "completion")],
            what="Image-text SFT",
        )
        kind = {("messages",): "messages", ("prompt", "completion"): "prompt_completion"}.get(
            found, "text"
        )
        self._refuse_vision_options(kind)
        template = getattr(self.processing_class, "chat_template", None) or ""
        if a.assistant_only_loss and not re.search(r"\{%-?\s*generation\s*-?%\}", template):
            raise ValueError(
                "assistant_only_loss=True needs a chat template that marks assistant turns with "
                "{% generation %} ... {% endgeneration %}; the processor's has none. Give one "
                "(chat_template_path) or set assistant_only_loss=False."
            )
        if len(dataset) == 0:
            raise ValueError(f"The {split} dataset is empty.")
        completion_only = a.completion_only_loss
        if completion_only is None:  # TRL: on for prompt-completion data
            completion_only = kind == "prompt_completion"
        counts = vision.image_counts(dataset)
        config = self.model.config.vision
        collator = vision.VisionCollator(
            self.processing_class,
            kind=kind,
            max_length=a.max_length,
            completion_only_loss=completion_only,
            dataset_text_field=a.dataset_text_field,
            max_images=max(counts),
            image_token_id=config.image_token_id,
            image_tokens=config.mm_tokens_per_image,
            assistant_only_loss=a.assistant_only_loss,
        )
        if self._vision_collator is not None:  # the eval set: the train set's kind and width
            if kind != self._vision_collator.kind:
                raise ValueError(
                    f"The {split} dataset is {kind} data but the train dataset "
                    f"{self._vision_collator.kind}; give both the same format."
                )
            collator.max_images = max(collator.max_images, self._vision_collator.max_images)
        self._vision_collator = collator
        text_only = dataset.remove_columns([c for c in columns if c in vision.IMAGE_COLUMNS])
        self._vision_lengths[id(dataset)] = [
            collator.token_count(ex, n) for ex, n in zip(text_only, counts, strict=True)
        ]
        return dataset

    def _max_length(self) -> int | None:
        # Rows used as given are not truncated (TRL): the longest sets the row length.
        return None if self.args.skip_prepare_dataset else super()._max_length()

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        pad_id = self.tokenizer.pad_token_id
        if self.vision:
            return self._vision_collator(examples, seq_len or self.seq_len, pad_id)
        batch = collate_sft(examples, seq_len or self.seq_len, pad_id)
        check_score_span(batch["loss_mask"], self.score_span)
        return batch

    def _fills_static_length(self, split: str) -> bool:
        # Packed rows are cut to `max_length` and filled (best fit or wrapped): a batch's
        # longest row is the static length but for an epoch's few leftover rows, so buckets
        # would save nothing and only add compiled shapes. TRL's `eval_packing` (None: as
        # `packing`) for every dataset but the training one.
        a = self.args
        if split == "train" or a.eval_packing is None:
            return a.packing
        return a.eval_packing

    def _loss_fn(self):
        return sft_algo.make_loss(
            self.args,
            self.apply_model,
            score_span=self.score_span,
            router_aux_coef=self.router_aux_loss_coef,
            padding_free=self._padding_free("train"),
        )

    def _loss_units(self):
        return sft_algo.loss_units

    def _prediction_fn(self):
        return sft_algo.predict
