"""DPOTrainer: direct preference optimisation with TRL `DPOTrainer` semantics.

One jitted step does the concatenated forward (chosen and rejected rows in one pass), the
reference forward without gradients (frozen copy of the initial policy held in the train state,
an explicit `ref_model`, an int8 weight-only copy, or log-probs precomputed once and cached on
disk), and the loss from `jaxrl.losses.dpo_multi_loss`. Metrics use TRL's names. The traced
math (pair log-probs in either layout, the loss) is `jaxrl.algos.dpo`; this file is the host
shell around it, with the reference forward (where the reference lives) and the predictions.

Datasets with images (TRL's vision-preference format) train an image-text model (Gemma 3): the
processor runs in the collator (`jaxrl.data.vision_preference`), and each pair's images go
through the vision tower once, their features read by both rows, in the policy's forward and
the reference's alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import lora
from jaxrl.algos import dpo as dpo_algo
from jaxrl.algos import reference
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.core import quant
from jaxrl.data import vision
from jaxrl.data.collate import collate_preference, collate_preference_shared
from jaxrl.data.formats import require_columns
from jaxrl.data.preference import prepare_preference_dataset
from jaxrl.data.vision_preference import VisionPreferenceCollator
from jaxrl.generation import Sampler
from jaxrl.losses.dpo import LABEL_SMOOTHING_TYPES
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.dpo_config import DPOConfig
from jaxrl.trainers.image_text import ImageTextMixin
from jaxrl.trainers.reference_model import ReferenceModelMixin
from jaxrl.trainers.sft import check_score_span, choose_score_span

logger = logging.getLogger("jaxrl")


class DPOTrainer(ImageTextMixin, ReferenceModelMixin, Trainer):
    """Direct preference optimisation (TRL `DPOTrainer` API; `args` is a `DPOConfig`). A train
    dataset with images (TRL's vision-preference format) trains an image-text model on them
    (`jaxrl.data.vision_preference`)."""

    config_class = DPOConfig
    _name = "DPO"
    _tag_names = ("trl", "dpo")
    _paper = {
        "title": "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
        "id": "2305.18290",
    }

    def __init__(self, model: Any, ref_model: Any = None, args: DPOConfig | None = None, *a, **kw):
        self._ref_model_arg = ref_model
        args = args if args is not None else DPOConfig(output_dir="trainer_output")
        self._validate(args, ref_model)
        # TRL's vision datasets: the processor runs in the collator, which one collator object
        # does for the train and eval sets; per-example (prompt, chosen, rejected) token counts
        # of the prepared image datasets, by `id` of the (kept) dataset object.
        a, kw = list(a), dict(kw)
        if a:
            train = a[0] = self._load_data(a[0], "train")
        else:
            train = kw["train_dataset"] = self._load_data(kw.get("train_dataset"), "train")
        self.vision = self._has_images(train)
        self._vision_collator: VisionPreferenceCollator | None = None
        self._vision_counts: dict[int, np.ndarray] = {}
        super().__init__(model, args, *a, **kw)
        self.score_span = self._score_span([self.train_dataset, self.eval_dataset])
        if self.is_peft:
            self._validate_peft(args, ref_model)
        self._explicit_ref = None
        # With precomputed reference log-probs the reference is loaded only to sample from it.
        if ref_model is not None and (
            not args.precompute_ref_log_probs or args.generate_during_eval
        ):
            self._explicit_ref = self._load_model(ref_model, task="causal_lm")
        if args.prefix_sharing:
            for m in (self.model, self._explicit_ref):
                if m is not None and any(m.config.sliding_layers):
                    raise ValueError(
                        "prefix_sharing=True is not supported for sliding-window attention "
                        "models (the window would count the other completion's tokens); set "
                        "prefix_sharing=False."
                    )
        if args.precompute_ref_log_probs:
            self._precompute_all()
        if args.sync_ref_model:
            self.callback_handler.add_callback(SyncRefModelCallback())

    @staticmethod
    def _validate(args: DPOConfig, ref_model: Any):
        types = args.loss_type if isinstance(args.loss_type, list) else [args.loss_type]
        if args.label_smoothing and not set(types) & set(LABEL_SMOOTHING_TYPES):
            warnings.warn(
                f"label_smoothing={args.label_smoothing} has no effect with loss_type={types}: "
                f"as in TRL 1.16, only {list(LABEL_SMOOTHING_TYPES)} read it (conservative DPO "
                "on 'sigmoid' was dropped from TRL; 'robust' is its unbiased form).",
                stacklevel=3,
            )
        if args.reference_free and (args.precompute_ref_log_probs or ref_model is not None):
            raise ValueError(
                "reference_free=True uses no reference model; drop ref_model and "
                "precompute_ref_log_probs."
            )
        if args.sync_ref_model and (args.precompute_ref_log_probs or args.reference_free):
            raise ValueError(
                "sync_ref_model=True needs a live reference model; it cannot be combined with "
                "precompute_ref_log_probs=True or reference_free=True."
            )

    @staticmethod
    def _validate_peft(args: DPOConfig, ref_model: Any):
        if args.sync_ref_model:
            raise ValueError(
                "sync_ref_model=True is not supported with LoRA (peft_config), as in TRL: the "
                "reference is the base model without the adapter, there is no separate reference "
                "to synchronise. Use sync_ref_model=False, or full fine-tuning."
            )
        if ref_model is None and args.ref_model_quantization is not None:
            raise ValueError(
                "ref_model_quantization quantizes a reference copy; with LoRA and no ref_model the "
                "reference is the frozen base itself. Quantize the base with quantization_config."
            )

    @property
    def _ref_is_base(self) -> bool:
        """LoRA without an explicit reference: the reference is the base without the adapter."""
        return self.is_peft and self._ref_model_arg is None

    def _models_prepared_at_init(self) -> bool:
        # TRL prepares its reference model, which it has unless PEFT or precomputed log-probs
        # stand in for it.
        return self.uses_ref_params and not self._ref_is_base

    @property
    def uses_ref_params(self) -> bool:
        a = self.args
        return not (a.reference_free or a.precompute_ref_log_probs)

    # ----------------------------------------------------------------- data
    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        a = self.args
        dataset = self._load_data(dataset, split)
        if self.vision:
            return self._prepare_vision_dataset(dataset, split)
        if self._has_images(dataset):
            raise ValueError(
                f"The {split} dataset has images but the train dataset has none; give the train "
                "dataset images too, or drop the image column."
            )
        return prepare_preference_dataset(
            dataset,
            self.processing_class,
            max_prompt_length=a.max_prompt_length,
            max_completion_length=a.max_completion_length,
            max_length=a.max_length,
            truncation_mode=a.truncation_mode,
            num_proc=a.dataset_num_proc,
        )

    # ----------------------------------------------------------------- image-text data
    def _refuse_vision_options(self, dataset: datasets.Dataset) -> None:
        """TRL 1.16's refusals for vision datasets, and the options jaxrl's image-text DPO does
        not run (an error rather than an ignored option)."""
        a = self.args
        tools = "tools" in dataset.column_names and any(
            t is not None and len(t) > 0 for t in dataset["tools"]
        )
        refusals = {
            # TRL: keep_end could cut the prompt's image tokens.
            "truncation_mode='keep_end'": a.truncation_mode == "keep_end"
            and a.max_length is not None,
            # TRL: the data is processed on the fly, never tokenized up front.
            "precompute_ref_log_probs=True": a.precompute_ref_log_probs,
            # TRL's vision-preference collator raises NotImplementedError.
            f"pad_to_multiple_of={a.pad_to_multiple_of}": a.pad_to_multiple_of is not None,
            # jaxrl: one row per pair holds no images (their tokens would need a mask of their own).
            "prefix_sharing=True": a.prefix_sharing,
            # jaxrl: TRL < 1.0 limits, not in TRL 1.16 (which cuts each row to max_length only).
            f"max_prompt_length={a.max_prompt_length}": a.max_prompt_length is not None,
            f"max_completion_length={a.max_completion_length}": a.max_completion_length is not None,
            # jaxrl: sampling does not take images.
            "generate_during_eval=True": a.generate_during_eval,
            # TRL's vision-preference collator renders without the tools column.
            "a 'tools' column": tools,
        }
        for option, set_ in refusals.items():
            if set_:
                raise ValueError(
                    f"{option} is not supported for DPO datasets with images (TRL 1.16 refuses "
                    "keep_end truncation with max_length, precompute_ref_log_probs and "
                    "pad_to_multiple_of there and renders no tools; jaxrl's image-text DPO does "
                    "not run prefix_sharing, max_prompt_length, max_completion_length or "
                    "generate_during_eval). Unset it, or drop the image column."
                )

    def _prepare_vision_dataset(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        """Vision rows stay as given (the collator processes them, as TRL's); their prompt,
        chosen and rejected token counts and image counts are read here, without processing any
        image."""
        if not self._has_images(dataset):  # TRL's collator reads every example's images
            raise ValueError(
                f"The train dataset has images but the {split} dataset has no image column; give "
                "it one (an empty 'images' list per row for text-only pairs), or drop the train "
                "dataset's."
            )
        require_columns(
            dataset.column_names,
            [("prompt", "chosen", "rejected")],
            what="Image-text DPO",
            hint="TRL's vision-preference format has an explicit prompt (it holds the images).",
        )
        self._refuse_vision_options(dataset)
        if len(dataset) == 0:
            raise ValueError(f"The {split} dataset is empty.")
        counts = vision.image_counts(dataset)
        config = self.model.config.vision
        if self._vision_collator is None:
            self._vision_collator = VisionPreferenceCollator(
                self.processing_class,
                max_length=self.args.max_length,
                max_images=max(counts),
                image_token_id=config.image_token_id,
                image_tokens=config.mm_tokens_per_image,
            )
        collator = self._vision_collator
        collator.max_images = max(collator.max_images, *counts)
        text_only = dataset.remove_columns(
            [c for c in dataset.column_names if c in vision.IMAGE_COLUMNS]
        )
        self._vision_counts[id(dataset)] = np.asarray(
            [collator.token_counts(ex, n) for ex, n in zip(text_only, counts, strict=True)],
            np.int64,
        ).reshape(-1, 3)
        return dataset

    def _vision_completion_width(self, dataset: datasets.Dataset) -> int:
        """The widest completion of a prepared image dataset after truncation to max_length."""
        p, c, r = self._vision_counts[id(dataset)].T
        widths = np.maximum(c, r)
        if self.args.max_length is not None:
            widths = np.minimum(widths, np.maximum(self.args.max_length - p, 0))
        return int(widths.max(initial=0))

    def _example_lengths(self, dataset: datasets.Dataset) -> list[int]:
        if self.vision:
            p, c, r = self._vision_counts[id(dataset)].T
            longest = p + np.maximum(c, r)
            cap = self.args.max_length
            return (longest if cap is None else np.minimum(longest, cap)).tolist()
        p, c, r = (
            dataset[k] for k in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
        )
        if self.args.prefix_sharing:
            return [len(pi) + len(ci) + len(ri) for pi, ci, ri in zip(p, c, r, strict=True)]
        return [len(pi) + max(len(ci), len(ri)) for pi, ci, ri in zip(p, c, r, strict=True)]

    def _score_span(self, sources: list) -> int | None:
        """How many slots of a row the LM head must run on: the longest completion of `sources`
        (datasets or lists of examples), or with prefix sharing the longest chosen + rejected,
        rounded up to a multiple of 8. A row's scored targets are its completions', from the
        last prompt token on, so skipping the prompt's positions leaves every log-prob and
        statistic unchanged while the head (a large share of a step at big vocabularies) runs
        on the completions only. None (the whole row) when it would not save anything."""
        longest = 0
        for ds in sources:
            if ds is None:
                continue
            if self.vision:
                if id(ds) not in self._vision_counts:  # examples, not a prepared dataset
                    return None
                longest = max(longest, self._vision_completion_width(ds))
                continue
            c, r = (
                ds[k] if isinstance(ds, datasets.Dataset) else [ex[k] for ex in ds]
                for k in ("chosen_input_ids", "rejected_input_ids")
            )
            if self.args.prefix_sharing:
                widths = (len(ci) + len(ri) for ci, ri in zip(c, r, strict=True))
            else:
                widths = (max(len(ci), len(ri)) for ci, ri in zip(c, r, strict=True))
            longest = max(longest, max(widths, default=0))
        return choose_score_span(longest, self.seq_len)

    def _max_length(self) -> int | None:
        # Each prompt + completion is already cut to max_length; a prefix-shared row holds two
        # completions, so its static length is the longest prompt + chosen + rejected, uncapped.
        return None if self.args.prefix_sharing else super()._max_length()

    def _pad_id(self) -> int:
        v = self.args.padding_value
        return self.tokenizer.pad_token_id if v is None else v

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        seq_len = seq_len or self.seq_len
        if self.vision:
            batch = self._vision_collator(examples, seq_len, self._pad_id())
            check_score_span(batch["loss_mask"].reshape(-1, seq_len), self.score_span)
        elif self.args.prefix_sharing:
            batch = collate_preference_shared(examples, seq_len, self._pad_id())
            scored = (batch["chosen_mask"] > 0) | (batch["rejected_mask"] > 0)
            check_score_span(scored, self.score_span)
        else:
            rows = collate_preference(examples, seq_len, self._pad_id())
            check_score_span(rows["loss_mask"], self.score_span)
            b = len(examples)
            batch = {k: np.stack([v[:b], v[b:]], axis=1) for k, v in rows.items()}
        if "ref_chosen_logps" in examples[0]:  # precomputed reference log-probs
            batch["ref_logps"] = np.asarray(
                [[ex["ref_chosen_logps"], ex["ref_rejected_logps"]] for ex in examples], np.float32
            )
        return batch

    def _collate_micro(
        self,
        examples: list[dict],
        accum: int,
        real: int | None = None,
        seq_len: int | None = None,
    ) -> dict[str, np.ndarray]:
        batch_A = super()._collate_micro(examples, accum, real, seq_len)
        if "sft" in self.args.loss_type:
            # Each row carries an equal share of this host's step totals, so summing a micro-batch
            # over the (global) batch axis on device gives the step's totals over all hosts.
            if "chosen_mask" in batch_A:
                chosen_AB = batch_A["chosen_mask"].sum(-1)
            else:
                chosen_AB = batch_A["loss_mask"][:, :, 0].sum(-1)
            w_AB = batch_A.get("example_mask", np.ones(chosen_AB.shape, np.float32))
            rows = chosen_AB.shape[1]
            shape = chosen_AB.shape
            total = (chosen_AB * w_AB).sum()
            batch_A["step_chosen_tokens"] = np.full(shape, total / rows, np.float32)
            batch_A["step_pairs"] = np.full(shape, w_AB.sum() / rows, np.float32)
        return batch_A

    # ----------------------------------------------------------------- reference model
    def _frozen_params(self, params: Any) -> dict[str, Any]:
        frozen = super()._frozen_params(params)
        if self.args.ref_model_quantization == "int8" and reference.REF in frozen:
            frozen[reference.REF] = quant.quantize_params(frozen[reference.REF])
        return frozen

    def _reference_copy(self, params: Any) -> Any:
        if self.args.ref_model_quantization is not None:  # from the full-precision weights
            return jax.tree.map(jnp.copy, params)  # frozen copy, sharded like the policy
        return self._frozen_copy(params)

    @property
    def _ref_pair_logps(self):
        """`(state, mb) -> (chosen, rejected)`: the reference's log-probs of a pair batch."""
        return dpo_algo.make_reference_logps(
            self.args, self._bind_reference, lora_base=self._ref_is_base, score_span=self.score_span
        )

    # ----------------------------------------------------------------- loss
    def _loss_fn(self):
        return dpo_algo.make_loss(
            self.args,
            self.apply_model,
            ref_logps=self._ref_pair_logps,
            score_span=self.score_span,
            router_aux_coef=self.router_aux_loss_coef,
        )

    def _loss_units(self):
        return dpo_algo.loss_units

    _prediction_groups = 2  # a `prompt + chosen` and a `prompt + rejected` row per pair

    def _prediction_fn(self):
        return dpo_algo.predict

    def _prediction_input_ids(self, mb: dict) -> jax.Array:
        if "branch_ids" in mb:
            return dpo_algo.shared_rows_input_ids(mb, self._pad_id())
        return dpo_algo.pairs_to_rows(mb)["input_ids"]

    # ----------------------------------------------------------------- generate_during_eval
    def _before_evaluation(self, dataset: datasets.Dataset) -> None:
        if self.args.generate_during_eval:
            self.log_game(dataset)

    def log_game(self, dataset: datasets.Dataset) -> list[dict]:
        """TRL < 1.0's `generate_during_eval`: sample one random eval batch of prompts
        (`per_device_eval_batch_size` x data-parallel devices, fewer if the dataset is smaller)
        from the policy and from the reference, and log them.

        As TRL: `do_sample=True` with the model's generation config otherwise, `max_length` tokens
        in total (new tokens = `max_length` - the batch's longest prompt; with `max_length=None`,
        `max_completion_length`, else 20 new tokens), special tokens skipped. Both models get the
        same prompts and seed. Rows go to the W&B table `game_log` (Prompt, Policy, Ref Model)
        when wandb is active and always to `output_dir/game_log.jsonl`; returns them.
        """
        a, step = self.args, self.state.global_step
        k = min(a.per_device_eval_batch_size * self.dp, len(dataset))
        picked = np.random.default_rng(a.seed + step).choice(len(dataset), k, replace=False)
        prompt_ids = [list(dataset[int(i)]["prompt_input_ids"]) for i in picked]
        longest = max(map(len, prompt_ids))
        if a.max_length is not None:
            budget = a.max_length - longest
        else:
            budget = a.max_completion_length or 20
        config = self.generation_config(None, do_sample=True, max_new_tokens=max(budget, 1))
        seed = a.seed + step
        policy = self.sample_texts(prompt_ids, config, seed=seed)
        sampler, params, context = self._game_reference()
        with context:
            ref = self.sample_texts(prompt_ids, config, params=params, sampler=sampler, seed=seed)
        tok = self.processing_class
        prompts = [tok.decode(ids, skip_special_tokens=True) for ids in prompt_ids]
        rows = [
            {"step": step, "prompt": p, "policy": pol, "ref_model": r}
            for p, pol, r in zip(prompts, policy, ref, strict=True)
        ]
        if not self.state.is_world_process_zero:
            return rows
        os.makedirs(a.output_dir, exist_ok=True)
        with open(os.path.join(a.output_dir, "game_log.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if "wandb" in a.report_to or "all" in a.report_to:
            import wandb

            if wandb.run is not None:
                data = [[r["prompt"], r["policy"], r["ref_model"]] for r in rows]
                table = wandb.Table(columns=["Prompt", "Policy", "Ref Model"], data=data)
                wandb.log({"game_log": table})
        return rows

    def _game_reference(self) -> tuple[Any, Any, Any]:
        """(sampler, params, context to sample in) of the reference model for `log_game`."""
        samplers = self.__dict__.setdefault("_game_samplers", {})
        state = self.train_state
        if self._ref_is_base:  # LoRA: the base with the adapter disabled (at trace time)
            adapter = state.params
            if "ref_saved" in state.frozen:
                adapter = nnx.merge_state(adapter, state.frozen["ref_saved"])
            if "base" not in samplers:
                samplers["base"] = Sampler(self.graphdef, mesh=self.mesh, rules=self.rules)
            params = nnx.merge_state(adapter, state.frozen["base"])
            return samplers["base"], params, lora.disable_adapter()
        if state.ref_params is not None:  # the frozen copy or the explicit ref_model
            if self._ref_graphdef is None:
                return self.sampler(), state.ref_params, contextlib.nullcontext()
            if "ref" not in samplers:
                samplers["ref"] = Sampler(self._ref_graphdef, mesh=self.mesh, rules=self.rules)
            return samplers["ref"], state.ref_params, contextlib.nullcontext()
        if self._explicit_ref is not None:  # precomputed log-probs of an explicit ref_model
            if "explicit" not in samplers:
                samplers["explicit"] = Sampler(self._explicit_ref, mesh=self.mesh, rules=self.rules)
            params = nnx.state(self._explicit_ref)
            return samplers["explicit"], params, contextlib.nullcontext()
        # reference_free, or precomputed log-probs of the initial policy: no reference is held,
        # and TRL then samples the policy itself (its null_ref_context is a no-op without PEFT).
        return self.sampler(), self.current_params(), contextlib.nullcontext()

    # ----------------------------------------------------------------- precompute
    def _cache_key(self, dataset: datasets.Dataset) -> str:
        h = hashlib.sha256()
        h.update(
            json.dumps(
                {
                    "model": self.model_path or "object",
                    "ref": str(self._ref_model_arg),
                    "seq_len": self.seq_len,
                    "length_buckets": self.length_buckets,
                    "chunk": self.args.logprob_chunk_size,
                    "score_span": self.score_span,
                    "prefix_sharing": self.args.prefix_sharing,
                    "ld_alpha": self.args.ld_alpha,
                    "dtype": str(self.compute_dtype),
                    "data": dataset._fingerprint,
                },
                sort_keys=True,
            ).encode()
        )
        return h.hexdigest()[:16]

    def _precompute_all(self):
        """One pass of the reference model over the data; results cached on disk."""
        ref = self._ref_model_arg if self._ref_model_arg is not None else None
        if self._explicit_ref is not None:
            ref_model = self._explicit_ref
        else:
            ref_model = self._load_model(ref, task="causal_lm") if ref is not None else self.model
        graphdef, params = nnx.split(ref_model)
        # LoRA without a ref_model: the reference is the base with the adapter disabled.
        ref_logps = jax.jit(
            dpo_algo.make_precompute_logps(
                graphdef, self.args, self.score_span, lora_base=ref is None and self.is_peft
            )
        )
        bs = (
            self.args.precompute_ref_batch_size or self.args.per_device_train_batch_size
        ) * self.dp
        cache_dir = os.path.join(self.args.output_dir, "ref_logps_cache")
        for name in ("train_dataset", "eval_dataset"):
            ds = getattr(self, name)
            if ds is None:
                continue
            path = os.path.join(cache_dir, f"{self._cache_key(ds)}.npy")
            if os.path.exists(path):
                out = np.load(path)
            else:
                out = self._run_precompute(ds, bs, params, ref_logps)
                if jax.process_index() == 0:
                    os.makedirs(cache_dir, exist_ok=True)
                    np.save(path + ".tmp.npy", out)
                    os.replace(path + ".tmp.npy", path)
            ds = ds.add_column("ref_chosen_logps", out[:, 0].tolist())
            setattr(self, name, ds.add_column("ref_rejected_logps", out[:, 1].tolist()))
