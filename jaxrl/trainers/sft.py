"""SFTTrainer: supervised fine-tuning with TRL `SFTTrainer` semantics on the generic step.

The loss is token-weighted NLL over `loss_mask` tokens (completion-only / assistant-only masks
come from the data layer), computed from hidden states with chunked log-probs so no full f32
[B, T, V] exists. Logged metrics use TRL's names: `loss`, `mean_token_accuracy`, `entropy`,
`num_tokens`, `grad_norm`, `learning_rate`.
"""

from __future__ import annotations

import re
from typing import Any

import datasets
import jax.numpy as jnp
import numpy as np

from jaxrl.config import SFTConfig
from jaxrl.core.logprobs import scored_logprobs, unembed_logits
from jaxrl.data import vision
from jaxrl.data.collate import collate_sft, model_masks
from jaxrl.data.sft import prepare_sft_dataset, rows_as_given
from jaxrl.losses.sft import entropy, mean_token_accuracy, sft_loss_sum
from jaxrl.trainers import router_aux
from jaxrl.trainers.base import Trainer, weighted_token_count
from jaxrl.trainers.evaluation import label_ids_from_loss_mask


def lm_hidden_states(model, mb: dict) -> jnp.ndarray:
    """Final hidden states [B, T, D] of a collated LM batch (masked only when packed), with its
    images when it has them (`jaxrl.data.vision`)."""
    attention_mask, segment_ids = model_masks(mb)
    images = {k: mb[k] for k in ("pixel_values", "token_type_ids") if k in mb}
    return model.hidden_states(
        mb["input_ids"], attention_mask, mb["positions"], segment_ids, **images
    )


def lm_forward(
    model,
    mb: dict,
    chunk_size: int,
    with_stats: bool,
    score_span: int | None = None,
    uniform_nll_grad: bool = False,
):
    """Per-token target log-probs (and stats) `[B, T]` of a collated LM batch; `score_span`
    as in `scored_logprobs` (rows scored where `loss_mask` is set); `uniform_nll_grad` as in
    `token_logprobs`."""
    return scored_logprobs(
        lm_hidden_states(model, mb),
        model.unembed_weight(),
        mb["targets"],
        mb["loss_mask"] > 0,
        chunk_size,
        with_stats,
        score_span,
        uniform_nll_grad=uniform_nll_grad,
        logit_softcap=model.config.final_logit_softcap,
    )


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
    """`lm_forward`'s `score_span` for rows whose scored targets lie within `width` positions:
    `width` rounded up to a multiple of 8, or None when that would not be shorter than a row."""
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


def full_logits(model, mb: dict) -> jnp.ndarray:
    """f32 logits [B, T, V] of a collated LM batch (eval predictions only; training never
    builds them)."""
    return unembed_logits(
        lm_hidden_states(model, mb), model.unembed_weight(), model.config.final_logit_softcap
    )


def example_weighted_mask(mb: dict) -> jnp.ndarray:
    """`loss_mask` with the rows of padding examples zeroed (`[..., B, T]`: one micro-batch or
    a whole `[A, B, T]` batch)."""
    mask_BT = mb["loss_mask"]
    if "example_mask" in mb:
        mask_BT = mask_BT * mb["example_mask"][..., None]
    return mask_BT


def lm_token_weights(mb: dict) -> jnp.ndarray:
    """1 on the real tokens of a collated LM batch's real examples (packed rows: every token of
    a segment), 0 on padding: the tokens TRL's MoE load-balancing loss counts."""
    tokens_BT = (mb["segment_ids"] > 0) if "segment_ids" in mb else mb["attention_mask"]
    tokens_BT = tokens_BT.astype(jnp.float32)
    if "example_mask" in mb:
        tokens_BT = tokens_BT * mb["example_mask"][..., None]
    return tokens_BT


class SFTTrainer(Trainer):
    """Supervised fine-tuning (TRL `SFTTrainer` API; `args` is an `SFTConfig`)."""

    config_class = SFTConfig
    _name = "SFT"
    _tag_names = ("trl", "sft")
    supports_images = True

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
        # The model generation config's EOS ids once `args.eos_token` has been put first
        # (None: unchanged).
        self._generation_eos_ids: list[int] | None = None
        super().__init__(model, args, *a, **kw)
        # Completion-only / assistant-only losses score part of each row: the LM head runs on
        # the widest trained stretch of the data only (`lm_forward`'s `score_span`).
        self.score_span = self._score_span([self.train_dataset, self.eval_dataset])

    def _apply_eos_token(self, tokenizer: Any) -> None:
        """The base's `eos_token` handling, and for a model that generates, the new EOS id goes
        first among the model generation config's EOS ids, ahead of the ones it had (TRL)."""
        old_ids = self._model_generation_eos_ids()  # read before the model config changes
        super()._apply_eos_token(tokenizer)
        new_id = int(tokenizer.eos_token_id)
        if new_id not in old_ids:  # else TRL leaves the generation config as it is
            self._generation_eos_ids = [new_id, *old_ids]

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
        if generation_config is None and self._generation_eos_ids is not None:
            overrides.setdefault("eos_token_id", tuple(self._generation_eos_ids))
        return super().generation_config(generation_config, **overrides)

    def _export_generation_config(self, out: str) -> Any:
        config = super()._export_generation_config(out)
        if self._generation_eos_ids is not None:
            config.eos_token_id = list(self._generation_eos_ids)
        return config

    def _load_model(self, model: Any, task: str):
        try:
            return super()._load_model(model, task)
        except ValueError as err:
            if self.vision and "vision=True needs an image-text checkpoint" in str(err):
                raise ValueError(
                    "The dataset has images (an 'image' or 'images' column) but the model is not "
                    f"an image-text model ({err}). Use an image-text Gemma 3 checkpoint "
                    "(Gemma3ForConditionalGeneration), or drop the image column."
                ) from err
            raise

    def _model_load_kwargs(self) -> dict[str, Any]:
        return {"vision": True} if self.vision else {}

    def _check_model(self, model: Any) -> None:
        if self.vision and getattr(getattr(model, "config", None), "vision", None) is None:
            raise ValueError(
                "The dataset has images (an 'image' or 'images' column) but the model does not "
                "take images: jaxrl trains image-text Gemma 3 checkpoints "
                "(Gemma3ForConditionalGeneration) on images. Use such a model, or drop the "
                "image column to train on text."
            )

    def _default_processing_class(self) -> Any:
        if not self.vision:
            return super()._default_processing_class()
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.model_path)

    def _load_tokenizer(self, processing_class):
        processing_class = super()._load_tokenizer(processing_class)
        if self.vision:
            from transformers import ProcessorMixin

            if not isinstance(processing_class, ProcessorMixin):
                raise ValueError(
                    "The dataset has images but processing_class is a tokenizer; image-text SFT "
                    "needs the model's processor (transformers.AutoProcessor), which turns "
                    "images into pixel values and image tokens."
                )
        return processing_class

    def _score_span(self, sources: list) -> int | None:
        if self.vision:  # rows are processed in the collator: every position is scored
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
                    "keep_end truncation, completion_only_loss on language modelling and "
                    "assistant_only_loss without conversational language-modelling data, and "
                    "skips the dataset preparation where formatting_func and shuffle_dataset "
                    "act). Unset it or drop the image column."
                )

    def _prepare_vision_dataset(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        """Vision rows stay as given (the collator processes them, as TRL's); their row lengths
        and image counts are read here, without processing any image."""
        from jaxrl.data.formats import require_columns

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
        chunk = self.args.logprob_chunk_size
        loss_type = getattr(self.args, "loss_type", "nll")

        smoothing = getattr(self.args, "label_smoothing_factor", 0.0)

        coef = self.router_aux_loss_coef

        def loss_fn(params, state, mb, rng, extras):
            model = self.apply_model(params, state)
            tokens_BT = lm_token_weights(mb)
            with router_aux.collect(bool(coef), tokens_BT) as router_stats:
                logps_BT, stats = lm_forward(
                    model, mb, chunk, True, self.score_span, uniform_nll_grad=bool(smoothing)
                )
            mask_BT = example_weighted_mask(mb)
            loss_sum, n_tok = sft_loss_sum(logps_BT, mask_BT, loss_type=loss_type)
            if smoothing:  # HF's LabelSmoother: (1 - eps) NLL + eps x uniform-target NLL
                uniform_sum = jnp.sum(stats["uniform_nll"] * mask_BT)
                loss_sum = (1 - smoothing) * loss_sum + smoothing * uniform_sum
            correct, _ = mean_token_accuracy(stats["argmax_correct"], mask_BT)
            ent, _ = entropy(stats["entropy"], mask_BT)
            sums = {"loss": loss_sum, "mean_token_accuracy": correct, "entropy": ent}
            counts = {"loss": n_tok, "mean_token_accuracy": n_tok, "entropy": n_tok}
            loss_sum = router_aux.add_to_loss(
                coef, router_stats, tokens_BT, mb, loss_sum, sums, counts
            )
            aux = {
                "sum": sums,
                "count": counts,
                "total": {
                    "num_tokens": weighted_token_count(mb["attention_mask"], mb).astype(jnp.float32)
                },
            }
            return loss_sum, (aux, extras)

        return loss_fn

    def _loss_units(self):
        return lambda batch_A: jnp.sum(example_weighted_mask(batch_A))

    def _prediction_fn(self):
        def predict(model, mb):
            logits_BTV = full_logits(model, mb)
            return logits_BTV, label_ids_from_loss_mask(mb["input_ids"], mb["loss_mask"])

        return predict
