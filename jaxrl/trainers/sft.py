"""SFTTrainer: supervised fine-tuning with TRL `SFTTrainer` semantics on the generic step.

The loss is token-weighted NLL over `loss_mask` tokens (completion-only / assistant-only masks
come from the data layer), computed from hidden states with chunked log-probs so no full f32
[B, T, V] exists. Logged metrics use TRL's names: `loss`, `mean_token_accuracy`, `entropy`,
`num_tokens`, `grad_norm`, `learning_rate`.
"""

from __future__ import annotations

from typing import Any

import datasets
import jax.numpy as jnp
import numpy as np

from jaxrl.config import SFTConfig
from jaxrl.core.logprobs import scored_logprobs, unembed_logits
from jaxrl.data.collate import collate_sft, model_masks
from jaxrl.data.sft import prepare_sft_dataset, rows_as_given
from jaxrl.losses.sft import entropy, mean_token_accuracy, sft_loss_sum
from jaxrl.trainers import router_aux
from jaxrl.trainers.base import Trainer, weighted_token_count
from jaxrl.trainers.evaluation import label_ids_from_loss_mask


def lm_hidden_states(model, mb: dict) -> jnp.ndarray:
    """Final hidden states [B, T, D] of a collated LM batch (masked only when packed)."""
    attention_mask, segment_ids = model_masks(mb)
    return model.hidden_states(mb["input_ids"], attention_mask, mb["positions"], segment_ids)


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

    def __init__(self, model: Any, args: SFTConfig | None = None, *a, formatting_func=None, **kw):
        self.formatting_func = formatting_func
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

    def _score_span(self, sources: list) -> int | None:
        widths = [trained_width(ds["loss_mask"]) for ds in sources if ds is not None]
        return choose_score_span(max(widths, default=self.seq_len), self.seq_len)

    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        a = self.args
        dataset = self._load_data(dataset, split)
        if a.skip_prepare_dataset:
            return rows_as_given(dataset, a.dataset_num_proc)
        return prepare_sft_dataset(
            dataset,
            self.processing_class,
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
        return [len(x) for x in dataset["input_ids"]]

    def _max_length(self) -> int | None:
        # Rows used as given are not truncated (TRL): the longest sets the row length.
        return None if self.args.skip_prepare_dataset else super()._max_length()

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        pad_id = self.processing_class.pad_token_id
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
