"""What the online trainers (GRPO, RLOO) hand the sampler: the prompts' token ids (the
`PROMPT_IDS` column `_prepare_dataset` adds, image-text prompts through
`jaxrl.data.vision_prompts`), the lengths read from them, the sampler's prompt buckets, and
the rollouts' sampling settings (`generation_kwargs`, every EOS id the model declares).

`OnPolicyPromptsMixin` is one of the pieces `jaxrl.trainers.onpolicy.OnPolicyTrainer` is
composed of. Host-side dataset preparation and settings only: no sampling, no scoring, no
traced code; it does not import `jaxrl.trainers.onpolicy`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import datasets

from jaxrl import generation
from jaxrl.config import ConfigError
from jaxrl.data import vision, vision_prompts
from jaxrl.data.formats import is_conversational
from jaxrl.generation import GenerationConfig

PROMPT_IDS = "prompt_ids"  # the tokenized prompt column added by `_prepare_dataset`


# `generation_kwargs` keys the rollouts honour (the sampler's fields), accept as harmless, or
# reject when set to anything that changes the output (`jaxrl.generation`'s list).
_GENERATION_KWARGS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",  # only read by encoder-decoder models
        "use_cache",  # the sampler always uses its KV cache
        "stop_strings",  # matched with the trainer's tokenizer (transformers' `tokenizer=`)
        *generation._UNSUPPORTED_HF_FIELDS,
    }
)
# Stop options of other libraries: TRL hands `generation_kwargs` to transformers'
# `GenerationConfig`, which keeps unknown names as attributes that `generate` never reads.
_FOREIGN_STOP_KWARGS = {
    "stop": "vLLM's SamplingParams name",
    "stop_token_ids": "vLLM's SamplingParams name",
    "stop_sequences": "jaxrl's GenerationConfig field, no transformers option",
}


class OnPolicyPromptsMixin:
    """`OnPolicyTrainer`'s prompt datasets and sampling settings (hooks of `Trainer`:
    `_prepare_dataset`, `_example_lengths`, `_max_length`)."""

    def _rollout_generation_config(self) -> GenerationConfig:
        """TRL's sampling settings for rollouts and eval: `max_completion_length` new tokens
        sampled with `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`, stopping
        at every EOS id, then `generation_kwargs` over them (TRL: they override the fields); an
        option the sampler does not implement is an error naming it. `stop_strings` end a
        completion at the token where one completes (transformers' `StopStringCriteria`; the
        sampler calls pass the trainer's tokenizer, as `generate(..., tokenizer=)` needs)."""
        from transformers import GenerationConfig as HFGenerationConfig

        a = self.args
        settings = {
            "max_new_tokens": a.max_completion_length,
            "do_sample": True,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "temperature": a.temperature,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "min_p": a.min_p,
            "repetition_penalty": a.repetition_penalty,
        }
        extra = dict(a.generation_kwargs or {})
        unknown = sorted(set(extra) - _GENERATION_KWARGS)
        foreign = [f"{k} ({_FOREIGN_STOP_KWARGS[k]})" for k in unknown if k in _FOREIGN_STOP_KWARGS]
        if foreign:
            raise ConfigError(
                f"generation_kwargs {', '.join(foreign)}: transformers' generate never reads "
                "it (TRL would silently ignore it), so jaxrl refuses it; to end completions "
                "pass stop_strings=[...] (texts, transformers' StopStringCriteria) or "
                "eos_token_id=[...] (ids that end a completion)."
            )
        if unknown:
            raise ConfigError(
                f"generation_kwargs {unknown} are not supported by jaxrl's sampler; it takes "
                f"{sorted(_GENERATION_KWARGS)} (an unsupported option is an error at its "
                "non-default values)."
            )
        settings.update(extra)
        try:
            config = GenerationConfig.from_transformers(HFGenerationConfig(**settings))
        except ValueError as e:
            raise ConfigError(f"GRPO/RLOO generation settings (generation_kwargs): {e}") from e
        if self.vision:
            # TRL (a processor as processing_class): "A sampled image token would mismatch the
            # image features", so generation suppresses it.
            image_token = self.model.config.vision.image_token_id
            config = dataclasses.replace(config, suppress_token_ids=(image_token,))
        return config

    def _eos_token_ids(self) -> list[int]:
        """TRL's stop ids: the tokenizer's EOS, then `model.generation_config.eos_token_id` (one
        id or a list). As transformers, the model's generation config is the model directory's
        `generation_config.json`, else derived from the model config (a model built from a
        config object); a user-built model with neither has only the tokenizer's EOS."""
        from transformers import GenerationConfig as HFGenerationConfig

        gen = None
        if self.model_path is not None:
            try:
                # A hub id's files are in the cache already (the model was loaded from there).
                gen = HFGenerationConfig.from_pretrained(self.model_path, local_files_only=True)
            except OSError:
                gen = None  # no generation_config.json: transformers derives it, as below
        if gen is None:
            hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
            if hf_config is not None:
                gen = HFGenerationConfig.from_model_config(hf_config)
        model_eos = getattr(gen, "eos_token_id", None)
        model_eos = (
            [] if model_eos is None else [model_eos] if isinstance(model_eos, int) else model_eos
        )
        tok_eos = self.tokenizer.eos_token_id
        ids = [int(i) for i in model_eos]
        if tok_eos is not None and tok_eos not in ids:
            ids = [int(tok_eos), *ids]
        return ids

    # ----------------------------------------------------------------- data
    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        dataset = self._load_data(dataset, split)
        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        if "prompt" not in dataset.column_names and getattr(self, "environment_pool", None):
            # TRL: an environment may own the data; each rollout's `reset()` gives the prompt
            # (an empty user message before it), tokenized per batch.
            return dataset.add_column(PROMPT_IDS, [[] for _ in range(len(dataset))])
        if "prompt" not in dataset.column_names:
            raise ValueError(
                f"The {split} dataset has columns {dataset.column_names} but GRPO/RLOO need a "
                "'prompt' column (a string, or a list of chat messages)."
            )
        if self.vision:
            return self._check_prompt_lengths(self._prepare_image_prompts(dataset, split), split)
        if vision.image_column(dataset.column_names) is not None:
            raise ValueError(
                f"The {split} dataset has images (an 'image' or 'images' column) but the train "
                "dataset has none; give the train dataset images too, or drop the column."
            )
        tok = self.processing_class
        kwargs = dict(self.args.chat_template_kwargs or {})
        tools = getattr(self, "tools", None) or None

        def tokenize(example):
            prompt = example["prompt"]
            if is_conversational({"prompt": prompt}):
                # The tools' schemas as transformers renders them (TRL: `tools or None`).
                ids = tok.apply_chat_template(
                    prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                    return_dict=True, **kwargs,
                )["input_ids"]  # fmt: skip
            else:
                ids = tok(text=prompt)["input_ids"]
            return {PROMPT_IDS: ids}

        return self._check_prompt_lengths(dataset.map(tokenize), split)

    def _check_prompt_lengths(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        """Every prompt plus `max_completion_length` must fit the model's positions
        (`max_position_embeddings`, the ceiling TRL's rollouts stop at): beyond it learned
        positions do not exist and RoPE ones were never trained."""
        positions = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        lengths = self._example_lengths(dataset)
        if not positions or not lengths:
            return dataset
        row = max(range(len(lengths)), key=lengths.__getitem__)
        longest, budget = lengths[row], self.args.max_completion_length
        if longest >= positions:
            raise ConfigError(
                f"Prompt {row} of the {split} dataset is {longest} tokens long, but the model has "
                f"only {positions} positions (max_position_embeddings), leaving no room for a "
                "completion. Drop or shorten the long prompts (e.g. dataset.filter on the "
                "prompt's token count), or use a model with a longer context."
            )
        if longest + budget > positions:
            raise ConfigError(
                f"max_completion_length={budget} plus the longest prompt of the {split} dataset "
                f"({longest} tokens, row {row}) is {longest + budget} tokens, beyond the model's "
                f"{positions} positions (max_position_embeddings). Lower max_completion_length "
                f"to at most {positions - longest}, or shorten the long prompts."
            )
        return dataset

    def _prepare_image_prompts(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        """`PROMPT_IDS` of image-text prompts (`jaxrl.data.vision_prompts`), read without
        decoding any image; the rows keep their images for the sampler and the rewards."""
        vision_config = self.model.config.vision
        if self._prompt_images is None:
            side = vision_config.image_size
            self._prompt_images = vision_prompts.PromptImages(
                self.processing_class,
                image_shape=(vision_config.num_channels, side, side),
                chat_template_kwargs=self.args.chat_template_kwargs,
            )
        counts = vision.image_counts(dataset)
        prompts = dataset.select_columns(["prompt"])["prompt"]
        conversational = [is_conversational({"prompt": p}) for p in prompts]
        if any(counts) and not all(conversational):
            raise ValueError(vision_prompts.NOT_CONVERSATIONAL)
        tok = self.tokenizer
        ids = [
            self._prompt_images.prompt_ids(p, n) if conv else tok(text=p)["input_ids"]
            for p, n, conv in zip(prompts, counts, conversational, strict=True)
        ]
        self.max_images = max(self.max_images, max(counts, default=0))
        return dataset.add_column(PROMPT_IDS, ids)

    def _example_lengths(self, dataset: datasets.Dataset) -> list[int]:
        return [len(ids) for ids in dataset[PROMPT_IDS]]

    def _max_length(self) -> int:
        return max(self._example_lengths(self.train_dataset or self.eval_dataset) or [1])

    def _prompt_buckets(self) -> list[int] | None:
        """TRL's `pad_to_multiple_of` as the sampler's prompt buckets (None: powers of two)."""
        m = self.args.pad_to_multiple_of
        if m is None:
            return None
        return [m * k for k in range(1, math.ceil(self._max_length() / m) + 1)]
