"""What the online language-model trainers share (GRPO, RLOO; PPO later): prompts -> sampler ->
rewards -> advantages -> jitted update.

One loop step is one optimizer update (TRL's `global_step`). As TRL, a generation batch of
`generation_batch_size` completions (`generation_batch_size / num_generations` prompts, each
sampled `num_generations` times in one sampler call that prefills the prompt once) serves
`steps_per_generation * num_iterations` micro-steps: `GenerationBatches` repeats each prompt
batch that many times (TRL's `RepeatSampler`), the iteration generates and scores when its buffer
is empty or a new cycle starts (after a resume it regenerates, as TRL when `_buffered_inputs is
None`; the sampling seed is a function of the generation index, so a resume at a cycle boundary
replays the same rollouts), shuffles the rows once and then feeds micro-step `m` the slice
`m % steps_per_generation` as one of the `gradient_accumulation_steps` micro-batches of a single
jitted `make_train_step` call.

Log-probs: completion tokens only, from `logits / temperature` (TRL), through
`jaxrl.algos.rollout` (chunked, never a full f32 [B, T, V]). The sampling policy's log-probs are
the sampler's own when a generation batch spans several optimizer steps with
`num_iterations == 1`; with `num_iterations > 1` one jitted forward recomputes them, as TRL; when
generation and update are aligned (the default) the update is on-policy and needs none. A
subclass supplies `_advantages` (per algorithm) and `_loss_fn` (built by `jaxrl.algos.<algo>`).
No algorithm math here.

Mixture-of-experts policies (`router_aux_loss_coef`, TRL's semantics, `jaxrl.algos.router_aux`):
the policy's loss forward, and no other (not the reference's, not the sampling policy's),
collects the routing statistics of the micro-batch's `prompt + completion` tokens
(`jaxrl.algos.rollout.rollout_token_weights`) and adds transformers' load-balancing loss as TRL does: `coef x
aux_loss` divided by the accumulation steps per micro-batch (GRPO divides the term itself; RLOO
returns it undivided and HF's Trainer divides), undivided in evaluation. The algorithms'
`_loss_units` hand `make_train_step` the step's loss-unit count, so that this weight holds
whatever a loss type counts (sequences, tokens, micro-batches). `aux_loss` is logged, the mean
over micro-batches.

Image prompts (an `image` / `images` column next to conversational prompts, an image-text Gemma
3; TRL 1.16's GRPOTrainer/RLOOTrainer with a processor): the prompt ids are the processor's chat
template of TRL's multimodal messages (`jaxrl.data.vision_prompts`, read when the dataset is
prepared), the pixel values the processor's (made per generation batch, each completion row
carrying its prompt's images, `[N, I, C, H, W]`); the sampler prefills with the images and never
samples the image token (TRL's `suppress_tokens`), and every log-prob forward (policy, sampling
policy, reference, eval) is the image-text one with the image tokens as `token_type_ids` (TRL
passes the processor's). Reward functions get TRL's multimodal prompts and the image column
(also with `remove_unused_columns`, TRL's signature columns keep it).

LoRA (`peft_config=`, optionally over a `quantization_config` base; TRL's semantics): the train
state holds the adapter (the optimizer sees nothing else) and the frozen base. The reference is
the base with the adapter disabled (no second copy of the weights), or, for a model that came
with a trained adapter, base + a frozen copy of that adapter (TRL's "ref" adapter). The sampler
generates through the adapter forward (`x W + s x A B` per adapted layer) rather than from a
merged copy: merging would materialise a full-precision copy of every adapted kernel per
generation (of the quantized QLoRA base too), and on the tiny CPU model the two are equally fast
(`examples/lora_sampler_timing.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import generation, lora, parallel
from jaxrl.algos.rollout import completion_logprobs, make_buffer_step, make_policy_logps
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.completions import write_completions_log
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import ConfigError
from jaxrl.core.step import make_eval_step, make_train_step, reduce_aux
from jaxrl.data import vision, vision_prompts
from jaxrl.data.batching import BatchIterator
from jaxrl.data.formats import is_conversational
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.rewards import (
    RewardFunc,
    completions_from_texts,
    compute_rewards,
    resolve_reward_weights,
    reward_func_name,
)
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.evaluation import hf_eval_loss, speed_metrics
from jaxrl.trainers.image_text import ImageTextMixin
from jaxrl.trainers.onpolicy_config import OnPolicyConfig
from jaxrl.trainers.reward_scoring import load_reward_model_func

logger = logging.getLogger("jaxrl")

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
        *generation._UNSUPPORTED_HF_FIELDS,
    }
)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one optimizer step consumes: the prompt batch of generation `generation`, whether
    this step starts its cycle, and the buffer slice of each micro-step."""

    generation: int
    starts_cycle: bool
    examples: list[dict]
    slices: tuple[int, ...]


class GenerationBatches:
    """Per optimizer step, a `StepPlan` (TRL `RepeatSampler` order); `.skip(n)` for resume."""

    def __init__(
        self, prompts: BatchIterator, *, generate_every: int, steps_per_generation: int, accum: int
    ):
        self.prompts = prompts
        self.generate_every = generate_every
        self.steps_per_generation = steps_per_generation
        self.accum = accum
        self.step = 0

    def skip(self, n: int) -> None:
        self.step += n

    def __iter__(self):
        return self

    def __next__(self) -> StepPlan:
        m0 = self.step * self.accum  # first micro-step of this optimizer step
        generation = m0 // self.generate_every
        self.step += 1
        return StepPlan(
            generation=generation,
            starts_cycle=m0 % self.generate_every == 0,
            examples=self.prompts.batch_at(generation),
            slices=tuple((m0 + j) % self.steps_per_generation for j in range(self.accum)),
        )


class OnPolicyTrainer(ImageTextMixin, Trainer):
    """Shared online shell; subclasses: `GRPOTrainer`, `RLOOTrainer` (see the module doc)."""

    config_class = OnPolicyConfig
    _metric_prefix_eval = "eval"
    # Metrics TRL may leave NaN (dropped from the logged window mean, as TRL's `log()` does; see
    # `_metric_may_be_nan`): the weighted reward's mean/std when no completion (or fewer than two)
    # is scorable, and the clip-ratio min/max when every completion of a step is masked. Besides
    # these: each reward function's `rewards/<name>/mean|std` (NaN when it returned None for the
    # whole batch) and the metrics reward functions log through `log_metric`.
    _nan_allowed_metrics = ("reward", "reward_std", "clip_ratio/low_min", "clip_ratio/high_max")

    def __init__(
        self,
        model: Any,
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
        args: OnPolicyConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[optax.GradientTransformation | None, Callable | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        args = args if args is not None else self.config_class(output_dir="trainer_output")
        if not isinstance(args, self.config_class):
            raise TypeError(f"args must be a {self.config_class.__name__}, got {type(args)}.")
        # TRL's prompt datasets with images (an `image` / `images` column, conversational
        # prompts): the model runs its vision tower, the processor makes the pixel values
        # (`jaxrl.data.vision_prompts`).
        if train_dataset is not None:
            train_dataset = self._load_data(train_dataset, "train")
        first = (
            train_dataset if train_dataset is not None else self._load_data(eval_dataset, "eval")
        )
        self.vision = vision.image_column(getattr(first, "column_names", None)) is not None
        self._prompt_images: vision_prompts.PromptImages | None = None
        # The most images a prompt of the run's datasets has: the static I of `pixel_values`.
        self.max_images = 0
        if self.vision and args.log_completions and args.log_multimodal:
            if "wandb" in (args.report_to or []):
                raise ConfigError(
                    "log_multimodal=True with wandb: jaxrl's completion tables do not log the "
                    "prompts' images (they log the prompts with their image parts stripped, as "
                    "TRL's parquet files). Set log_multimodal=False."
                )
        # TRL: a model that arrives with a trained adapter keeps a frozen copy of it as the
        # reference; a fresh adapter (peft_config) uses the base with the adapter disabled.
        self._ref_is_initial_adapter = getattr(model, "lora_config", None) is not None
        callbacks = list(callbacks or [])
        if args.sync_ref_model:
            if peft_config is not None or self._ref_is_initial_adapter:
                raise ValueError(
                    "sync_ref_model=True is not supported with LoRA (peft_config), as in TRL: the "
                    "reference is the base model without the adapter, there is no reference "
                    "model to synchronise. Use sync_ref_model=False, or full fine-tuning."
                )
            callbacks.append(SyncRefModelCallback())
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            quantization_config=quantization_config,
        )
        a = self.args
        self.reward_funcs = self._load_reward_funcs(reward_funcs, reward_processing_classes)
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        self.reward_weights = resolve_reward_weights(a.reward_weights, len(self.reward_funcs))
        self.generation_batch_size, self.steps_per_generation = a.resolve_generation_batch(self.dp)
        self.generate_every = self.steps_per_generation * a.num_iterations
        if self.generate_every % a.gradient_accumulation_steps:
            raise ConfigError(
                f"steps_per_generation x num_iterations ({self.generate_every}) must be a "
                f"multiple of gradient_accumulation_steps ({a.gradient_accumulation_steps}) so "
                "that no optimizer step spans two generation batches."
            )
        a.check_eval_batch(self.dp)
        # TRL: every EOS id the model declares (its generation config's, e.g. an end-of-turn
        # token) ends a completion, besides the tokenizer's.
        self.eos_token_ids = self._eos_token_ids()
        # Not `generation_config`: that is `Trainer.generation_config()`, which
        # `generate_completions` and the completion callbacks call.
        self.rollout_generation_config = self._rollout_generation_config()
        # Not `sampler`: that is `Trainer.sampler()`, which `generate_completions` calls (it
        # returns this one once compiled, see `sampler`).
        self.rollout_sampler: Sampler | None = None
        # The current generation batch (device arrays, rows shuffled): `input_ids`,
        # `attention_mask`, `completion_mask`, `advantages`, `num_items_in_batch` and, when used,
        # `old_logps`/`ref_logps`.
        self.rollout: dict[str, jax.Array] | None = None
        self._buffer_generation = -1
        self._buffer_metrics: dict[str, float] = {}
        self._buffer_tokens = 0.0
        # What reward functions log through TRL's `log_metric` / `log_extra` hooks during one
        # scoring call (see `_sample`), and the names of the metrics logged so far.
        self._pending_metrics: dict[str, list[float]] = defaultdict(list)
        self._pending_extras: dict[str, list] = defaultdict(list)
        self._user_metric_names: set[str] = set()
        # TRL's `_logs["extra"]`: the `log_extra` columns of the latest `generation_batch_size`
        # completions (TRL shows them in its completions table, `log_completions`).
        self.completion_extras: dict[str, deque] = defaultdict(
            lambda: deque(maxlen=self.generation_batch_size)
        )
        # The rest of TRL's `_logs` (`log_completions`): prompts, completions, each reward
        # function's rewards and the advantages of the latest `generation_batch_size`
        # completions, train and eval alike. Metrics are logged one step late, after the next
        # step has generated, so each step keeps a copy of them as they were when it ran.
        gbs = self.generation_batch_size
        self.completion_logs: dict[str, Any] = {
            "prompt": deque(maxlen=gbs),
            "completion": deque(maxlen=gbs),
            "rewards": {name: deque(maxlen=gbs) for name in self.reward_func_names},
            "advantages": deque(maxlen=gbs),
        }
        self._completion_logs_at: dict[int, dict[str, Any]] = {}
        if a.log_completions and self.is_world_process_zero():
            os.makedirs(os.path.join(a.output_dir, "completions"), exist_ok=True)

    def _rollout_generation_config(self) -> GenerationConfig:
        """TRL's sampling settings for rollouts and eval: `max_completion_length` new tokens
        sampled with `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`, stopping
        at every EOS id, then `generation_kwargs` over them (TRL: they override the fields); an
        option the sampler does not implement is an error naming it."""
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

    def _metric_may_be_nan(self, key: str) -> bool:
        if super()._metric_may_be_nan(key) or key in self._user_metric_names:
            return True
        return any(key in (f"rewards/{n}/mean", f"rewards/{n}/std") for n in self.reward_func_names)

    # ----------------------------------------------------------------- rewards
    def _load_reward_funcs(self, reward_funcs, tokenizers) -> list[RewardFunc]:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty; pass at least one reward function or model.")
        if tokenizers is not None and not isinstance(tokenizers, (list, tuple)):
            tokenizers = [tokenizers]
        if tokenizers is not None and len(tokenizers) != len(funcs):
            raise ValueError(
                f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward "
                "functions; give one per reward function (None for callables)."
            )
        # TRL prepares reward models (and the reference, `_models_prepared_at_init`) in __init__.
        self._has_reward_models = any(isinstance(func, str) for func in funcs)
        out = []
        for i, func in enumerate(funcs):
            if isinstance(func, str):
                tok = tokenizers[i] if tokenizers is not None else None
                out.append(
                    load_reward_model_func(
                        func, tokenizer=tok, chat_template_kwargs=self.args.chat_template_kwargs
                    )
                )
            elif callable(func):
                out.append(func)
            else:
                raise TypeError(
                    f"reward_funcs[{i}] is a {type(func).__name__}; pass a callable "
                    "(prompts, completions, **kwargs) -> list[float] or a reward model path."
                )
        return out

    # ----------------------------------------------------------------- data
    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        dataset = self._load_data(dataset, split)
        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        if "prompt" not in dataset.column_names:
            raise ValueError(
                f"The {split} dataset has columns {dataset.column_names} but GRPO/RLOO need a "
                "'prompt' column (a string, or a list of chat messages)."
            )
        if self.vision:
            return self._prepare_image_prompts(dataset, split)
        if vision.image_column(dataset.column_names) is not None:
            raise ValueError(
                f"The {split} dataset has images (an 'image' or 'images' column) but the train "
                "dataset has none; give the train dataset images too, or drop the column."
            )
        tok = self.processing_class
        kwargs = dict(self.args.chat_template_kwargs or {})

        def tokenize(example):
            prompt = example["prompt"]
            if is_conversational({"prompt": prompt}):
                ids = tok.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
                )["input_ids"]
            else:
                ids = tok(text=prompt)["input_ids"]
            return {PROMPT_IDS: ids}

        return dataset.map(tokenize)

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

    # ----------------------------------------------------------------- sizes and iteration
    @property
    def train_batch_size(self) -> int:
        return (
            self.args.per_device_train_batch_size * self.dp * self.args.gradient_accumulation_steps
        )

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.args.num_generations

    def _prompt_iterator(self) -> BatchIterator:
        return BatchIterator(
            self.train_dataset,
            global_batch_size=self.prompts_per_generation,
            seed=self.args.seed,
            shuffle=self.args.shuffle_dataset,
            drop_last=True,
            collate_fn=list,
        )

    @property
    def steps_per_epoch(self) -> int:
        n_gen = self._prompt_iterator().steps_per_epoch
        return max(1, n_gen * self.generate_every // self.args.gradient_accumulation_steps)

    def _train_iterator(self) -> GenerationBatches:
        return GenerationBatches(
            self._prompt_iterator(),
            generate_every=self.generate_every,
            steps_per_generation=self.steps_per_generation,
            accum=self.args.gradient_accumulation_steps,
        )

    # ----------------------------------------------------------------- subclass hooks
    def _advantages(
        self,
        rewards_NK: np.ndarray,
        rollout: dict[str, jax.Array],
        num_generations: int | None = None,
    ) -> tuple[jax.Array, dict[str, float]]:
        """`(advantages_N, metrics)` of one generation batch (per algorithm), its rows in groups
        of `num_generations` (default `args.num_generations`; eval: `num_generations_eval`)."""
        raise NotImplementedError

    def _loss_units(self) -> Callable[[dict], jax.Array]:
        """The summed loss-unit count (`aux["count"]["loss"]`) of one step's micro-batches
        `batch_A` (per algorithm): `make_train_step` hands each micro-batch its share, with
        which `router_aux.add_to_loss` weights the MoE load-balancing loss as TRL does (each
        micro-batch's `coef x aux_loss / gradient_accumulation_steps`)."""
        raise NotImplementedError

    def _needs_ref(self) -> bool:
        return self.args.beta != 0.0

    def _kl_in_reward(self) -> bool:
        """Whether the advantages need the sampling policy's log-probs (RLOO's KL reward)."""
        return False

    def _needs_old_logps(self) -> bool:
        """Whether the update needs the sampling policy's log-probs (TRL: when a generation
        batch spans more than one optimizer step)."""
        return self.generate_every != self.args.gradient_accumulation_steps

    def _models_prepared_at_init(self) -> bool:
        # TRL's reference model exists when beta != 0 without PEFT (the adapter off stands in).
        has_ref_model = self._needs_ref() and not self.is_peft
        return has_ref_model or getattr(self, "_has_reward_models", False)

    # ----------------------------------------------------------------- state
    def _frozen_params(self, params: Any) -> dict[str, Any]:
        if not self._needs_ref():
            return {}  # beta == 0: no reference model at all, as TRL
        if not self.is_peft:
            return {"ref": self._frozen_copy(params)}
        if self._ref_is_initial_adapter:
            # An adapter-sized copy: the reference is base + the adapter as it was loaded.
            return {"ref_adapter": jax.tree.map(jnp.copy, params)}
        # No second copy of the weights: the reference is the frozen base with the adapter
        # disabled. modules_to_save params are trained in full, so their initial values are
        # kept (PEFT's disable_adapter() runs the original modules).
        saved = nnx.filter_state(params, lora.SavedParam)
        has_saved = bool(jax.tree.leaves(saved))
        return {"ref_saved": jax.tree.map(jnp.copy, saved)} if has_saved else {}

    def reference_logps(self, state, batch: dict[str, jax.Array]) -> jax.Array:
        """Completion log-probs `[B, C]` of `batch` under the reference (a pure function of the
        train state, jitted by the trainer): the frozen copy, or with LoRA the base without the
        adapter (or, for a model that came with an adapter, base + that adapter as loaded)."""
        a = self.args

        def logps(model):
            return completion_logprobs(
                model, batch, temperature=a.temperature, chunk_size=a.logprob_chunk_size
            )

        if not self.is_peft:
            return logps(self.apply_model(state.frozen["ref"]))
        if self._ref_is_initial_adapter:
            return logps(self.apply_model(state.frozen["ref_adapter"], state))
        adapter = state.params
        if "ref_saved" in state.frozen:
            adapter = nnx.merge_state(adapter, state.frozen["ref_saved"])
        with lora.disable_adapter():  # read when the model is traced: the call must be inside
            return logps(self.apply_model(adapter, state))

    def _compile(self, state) -> None:
        a = self.args
        state_sh = self._state_shardings(state)
        repl = NamedSharding(self.mesh, P())
        step = make_train_step(
            self._with_model_dropout(self._with_lora_dropout(self._loss_fn())),
            self.tx,
            self.schedule,
            self._state_updates(),
            loss_units=self._loss_units() if self.router_aux_loss_coef else None,
        )
        self._jit_train_step = jax.jit(
            make_buffer_step(step, self.steps_per_generation),
            in_shardings=(state_sh, None, None),
            out_shardings=(state_sh, repl),
            donate_argnums=0,
        )
        self._jit_logps = jax.jit(make_policy_logps(a, self.apply_model))
        self._jit_ref_logps = jax.jit(self.reference_logps)
        # The training loss, forward only and without dropout (TRL evaluates in eval mode):
        # `evaluate()`'s per-batch `eval_loss`.
        self._jit_eval_step = jax.jit(make_eval_step(self._loss_fn()), out_shardings=repl)
        self.rollout_sampler = Sampler(
            self.graphdef, mesh=self.mesh, rules=self.rules, prompt_buckets=self._prompt_buckets()
        )

    def sampler(self) -> Sampler:
        """The rollout sampler once compiled (its prompt buckets too), else `Trainer.sampler()`."""
        if self.rollout_sampler is not None:
            return self.rollout_sampler
        return super().sampler()

    def _rollout_sharding(self) -> NamedSharding:
        (batch_axes,) = parallel.logical_to_spec(("batch",), self.rules)
        return NamedSharding(self.mesh, P(batch_axes))

    # ----------------------------------------------------------------- rollout
    def _sample(self, params, examples: list[dict], group_size: int, config, seed) -> dict:
        """Generate `group_size` completions per prompt; host-side decoded texts and rewards.
        Image prompts: the prompts' `pixel_values` [B, I, C, H, W] go to the sampler (and are
        returned for the rollout rows); the reward functions get TRL's multimodal prompts (the
        images in their messages) and the `image` / `images` column."""
        prompt_ids = [ex[PROMPT_IDS] for ex in examples]
        pixel_values = None
        has_images = self.vision and any(vision.example_images(ex) for ex in examples)
        if self.vision and self.max_images:
            pixel_values = self._prompt_images.pixel_values(examples, prompt_ids, self.max_images)
        out = self.rollout_sampler(
            params, prompt_ids, config, seed=seed, group_size=group_size,
            pixel_values=pixel_values,
        )  # fmt: skip
        completion_ids_NC = np.asarray(out.completion_ids_BN)
        mask_NC = np.asarray(out.completion_mask_BN)
        lengths_N = mask_NC.sum(axis=1)
        ids_list = [row[:n].tolist() for row, n in zip(completion_ids_NC, lengths_N, strict=True)]
        truncated_N = self._truncated(ids_list, config)
        rows = [ex for ex in examples for _ in range(group_size)]
        prompts = [ex["prompt"] for ex in rows]
        if has_images:  # TRL: `prepare_multimodal_messages(prompt, images)` once a batch has any
            prompts = [
                vision_prompts.prompt_messages(ex["prompt"], vision.example_images(ex))
                for ex in rows
            ]
        texts = self.tokenizer.batch_decode(ids_list, skip_special_tokens=True)
        completions = completions_from_texts(prompts, texts)
        columns = {}
        if not self.args.remove_unused_columns:
            skip = ("prompt", PROMPT_IDS)
            columns = {k: [ex[k] for ex in rows] for k in examples[0] if k not in skip}
        elif self.vision:  # TRL's signature columns keep the images
            columns = {k: [ex[k] for ex in rows] for k in vision.IMAGE_COLUMNS if k in examples[0]}
        self._pending_metrics.clear()
        self._pending_extras.clear()
        rewards_NK = compute_rewards(
            self.reward_funcs,
            prompts,
            completions,
            completion_ids=ids_list,
            columns=columns,
            trainer_state=self.state,
            log_extra=self._log_completion_extra,
            log_metric=self._log_metric,
        )
        # TRL: each logged metric's mean over this scoring call's values.
        user_metrics = {
            name: float(np.mean(values)) for name, values in sorted(self._pending_metrics.items())
        }
        self._user_metric_names.update(user_metrics)
        for column, values in self._pending_extras.items():
            self.completion_extras[column].extend(values)
        self._pending_metrics.clear()
        self._pending_extras.clear()
        return dict(
            out=out,
            pixel_values=pixel_values,
            lengths_N=lengths_N,
            truncated_N=truncated_N,
            rewards_NK=rewards_NK,
            prompts=prompts,
            completions=completions,
            user_metrics=user_metrics,
        )

    def _truncated(self, ids_list: list[list[int]], config: GenerationConfig) -> np.ndarray:
        """`[N]` bool: the completion does not end with a stop id (EOS) or the pad token, i.e. it
        hit `max_completion_length` (TRL counts the pad token as a proper end too)."""
        stop = {*config.stop_ids, self.tokenizer.pad_token_id}
        return np.array([not ids or ids[-1] not in stop for ids in ids_list], dtype=bool)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` hook for reward functions: a scalar metric; every value logged
        while scoring one generation batch counts, their mean is logged with its metrics."""
        self._pending_metrics[name].append(float(value))

    def _log_completion_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` hook for reward functions: an extra column (one value per
        completion) for the completions table, kept in `completion_extras` (TRL `_logs`)."""
        self._pending_extras[column].extend(values)

    def _rollout_rows(self, s: dict) -> dict[str, jax.Array]:
        """`input_ids`, `attention_mask` `[N, P + C]` and the loss mask `completion_mask`
        `[N, C]` of one `_sample` call (truncated completions masked out of the loss with
        `mask_truncated_completions`, as TRL)."""
        out = s["out"]
        completion_mask_NC = out.completion_mask_BN
        if self.args.mask_truncated_completions:
            keep_N1 = jnp.asarray(~s["truncated_N"], completion_mask_NC.dtype)[:, None]
            completion_mask_NC = completion_mask_NC * keep_N1
        rows = {
            "input_ids": jnp.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1),
            "attention_mask": jnp.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1),
            "completion_mask": completion_mask_NC,
        }
        if s.get("pixel_values") is not None:  # each completion row carries its prompt's images
            pixels = s["pixel_values"]
            group_size = completion_mask_NC.shape[0] // len(pixels)
            rows["pixel_values"] = jnp.repeat(jnp.asarray(pixels), group_size, axis=0)
        return rows

    def _generate_and_score(self, plan: StepPlan) -> None:
        """Fill the buffer with one scored, shuffled generation batch (see the module doc)."""
        a = self.args
        G = a.num_generations
        state = self.train_state
        seed = jax.random.fold_in(jax.random.key(a.seed), plan.generation)
        # With LoRA the sampler runs base + adapter through the adapter forward (no merged copy
        # of the weights; see OnPolicyTrainer's module doc).
        policy = self.current_params()
        s = self._sample(policy, plan.examples, G, self.rollout_generation_config, seed)
        out = s["out"]
        rollout = self._rollout_rows(s)
        completion_mask_NC = rollout["completion_mask"]
        N = completion_mask_NC.shape[0]
        # TRL's `num_items_in_batch`: the generation batch's loss tokens (one copy per row, so
        # it travels with any slice of the buffer).
        rollout["num_items_in_batch"] = jnp.full(
            (N,), jnp.sum(completion_mask_NC, dtype=jnp.float32), jnp.float32
        )
        if self._needs_old_logps() or self._kl_in_reward():
            if a.num_iterations > 1:
                old = self._jit_logps(policy, rollout)
            else:  # the sampler's log-probs are the sampling policy's (same temperature)
                old = out.logprobs_BN
            rollout["old_logps"] = old
        if self._needs_ref():
            rollout["ref_logps"] = self._jit_ref_logps(state, rollout)
        advantages_N, metrics = self._advantages(s["rewards_NK"], rollout)
        rollout["advantages"] = advantages_N
        self._record_completions(s, advantages_N)
        if not self._needs_old_logps():
            rollout.pop("old_logps", None)
        metrics.update(self._completion_metrics(s["lengths_N"], s["truncated_N"]))
        metrics.update(s["user_metrics"])
        # TRL shuffles the generation batch once before splitting it into micro-step slices.
        order = np.random.default_rng([a.seed, plan.generation]).permutation(len(advantages_N))
        sharding = self._rollout_sharding()
        self.rollout = {
            k: jax.device_put(jnp.take(v, jnp.asarray(order), axis=0), sharding)
            for k, v in rollout.items()
        }
        self._buffer_generation = plan.generation
        self._buffer_metrics = metrics
        self._buffer_tokens = float(np.asarray(out.prompt_mask_BP).sum() + s["lengths_N"].sum())

    @staticmethod
    def _completion_metrics(lengths_N: np.ndarray, truncated_N: np.ndarray) -> dict[str, float]:
        lengths_N = lengths_N.astype(np.float64)
        term = lengths_N[~truncated_N]
        term = term if term.size else np.zeros(1)
        return {
            "completions/mean_length": float(lengths_N.mean()),
            "completions/min_length": float(lengths_N.min()),
            "completions/max_length": float(lengths_N.max()),
            "completions/clipped_ratio": float(truncated_N.mean()),
            "completions/mean_terminated_length": float(term.mean()),
            "completions/min_terminated_length": float(term.min()),
            "completions/max_terminated_length": float(term.max()),
        }

    # ----------------------------------------------------------------- completion logs
    def _record_completions(self, s: dict, advantages_N: Any) -> None:
        """Add one scored `_sample` call to `completion_logs` (TRL's `_logs`)."""
        logs = self.completion_logs
        # TRL's tables hold the prompts without their images (`strip_images_from_messages`).
        logs["prompt"].extend(vision_prompts.strip_images(p) for p in s["prompts"])
        logs["completion"].extend(s["completions"])
        rewards_NK = np.asarray(s["rewards_NK"], np.float64)
        for k, name in enumerate(self.reward_func_names):
            logs["rewards"][name].extend(rewards_NK[:, k].tolist())
        logs["advantages"].extend(np.asarray(advantages_N, np.float64).tolist())

    def _completion_logs_copy(self) -> dict[str, Any]:
        logs = self.completion_logs
        return {
            "prompt": list(logs["prompt"]),
            "completion": list(logs["completion"]),
            "rewards": {name: list(v) for name, v in logs["rewards"].items()},
            "advantages": list(logs["advantages"]),
            "extra": {name: list(v) for name, v in self.completion_extras.items()},
        }

    def log(self, logs: dict[str, float], step: int | None = None):
        """HF's `log`, then TRL's `log_completions` on process 0: the completions behind this
        log (the latest `generation_batch_size`) printed as a rich table
        (`num_completions_to_print` random ones; all when None), written to
        `output_dir/completions/completions_<step>.parquet` and, when wandb runs, logged as the
        wandb Table `completions` (one row per prompt with `log_unique_prompts`)."""
        super().log(logs, step)
        a = self.args
        if not (a.log_completions and self.is_world_process_zero()):
            return
        step = self.state.global_step if step is None else step
        at = self._completion_logs_at
        # An evaluation logs the completions it just made (TRL's live `_logs`); a training log
        # those of its step.
        is_eval = any(k.startswith("eval_") for k in logs)
        snapshot = None if is_eval else at.pop(step, None)
        for old in [k for k in at if k <= step and not is_eval]:
            del at[old]
        if snapshot is None:
            snapshot = self._completion_logs_copy()
        if snapshot["prompt"]:
            write_completions_log(
                snapshot,
                step,
                out_dir=os.path.join(a.output_dir, "completions"),
                num_to_print=a.num_completions_to_print,
                unique_prompts=a.log_unique_prompts,
                to_wandb="wandb" in a.report_to,
            )

    # ----------------------------------------------------------------- the on-policy iteration
    def _train_iteration(self, plan: StepPlan) -> dict:
        generated = plan.starts_cycle or self._buffer_generation != plan.generation
        if generated:
            self._generate_and_score(plan)
        if self.args.log_completions:  # this step logs the completions as they are now
            self._completion_logs_at[self.state.global_step + 1] = self._completion_logs_copy()
        slices_A = jnp.asarray(plan.slices, jnp.int32)
        self.train_state, metrics = self._jit_train_step(self.train_state, self.rollout, slices_A)
        # Generation metrics ride on every step of their cycle, so the window mean is TRL's mean
        # over generations; the token count only on the step that generated.
        metrics = {**metrics, **self._buffer_metrics}
        metrics["num_tokens"] = self._buffer_tokens if generated else 0.0
        return metrics

    # ----------------------------------------------------------------- eval
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL 1.16's GRPO/RLOO evaluation, with HF's `eval_loss` and speed metrics.

        The eval prompts go in batches of `per_device_eval_batch_size` x data-parallel devices
        completions (`num_generations_eval` per prompt, default `num_generations`), each batch
        sampled, scored and given its advantages (groups of `num_generations_eval`) as TRL's
        `prediction_step` does, then run through the training loss: `<prefix>_loss` is HF's mean
        of the batch losses. As in TRL's eval the old log-probs are the evaluated policy's own
        (ratio 1: no clipping, no off-policy masking), the reference KL enters when `beta > 0`
        (GRPO: `beta x k3` in the loss; RLOO: in the reward, hence the advantages), and the loss
        is aggregated as `loss_type` does in training, a token-normalised type (`dapo`, `cispo`,
        `vespo`) over the eval batch's own active tokens (over several data-parallel devices the
        loss is the global batch's, which TRL's per-process losses average to, `bnpo` aside: TRL
        averages the processes' token means). HF weights each batch by the eval batch size, the
        last by `len(eval_dataset) % batch size` when non-zero (accelerate's remainder, counted
        in prompts under TRL's repeat sampler), and leaves out non-finite batch losses when some
        are finite. Besides: the reward and completion metrics of the
        sampled completions, greedy decoding (`<prefix>_greedy/...`: one completion per prompt,
        e.g. exact-match accuracy for a correctness reward; jaxrl's, not TRL's), and HF's
        `<prefix>_runtime`, `_samples_per_second`, `_steps_per_second` (samples are eval
        prompts, steps `ceil(prompts / batch size)` as HF counts them; the greedy pass is timed
        too)."""
        self._prepare_for_evaluation()
        a = self.args
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._prepare_dataset(eval_dataset, "eval")
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        G = a.num_generations_eval or a.num_generations
        batch_size = a.per_device_eval_batch_size * self.dp  # completions, as TRL's eval batch
        per_batch = max(1, batch_size // G)
        start_time = time.time()
        sampling = self.rollout_generation_config
        greedy = dataclasses.replace(sampling, do_sample=False)
        sampled: list[dict] = []
        greedy_rewards = []
        user_metrics: dict[str, list[float]] = defaultdict(list)
        batch_losses: list[float] = []
        batch_metrics: dict[str, list[float]] = defaultdict(list)
        rows = [ds[i] for i in range(len(ds))]
        policy = self.current_params()
        for b, start in enumerate(range(0, len(rows), per_batch)):
            examples = rows[start : start + per_batch]
            seed = jax.random.fold_in(jax.random.key(a.seed + 1), b)
            s = self._sample(policy, examples, G, sampling, seed)
            sampled.append(s)
            loss, values = self._eval_batch(policy, s, G)
            batch_losses.append(loss)
            values.update(self._completion_metrics(s["lengths_N"], s["truncated_N"]))
            for name, value in values.items():
                batch_metrics[name].append(value)
            g = self._sample(policy, examples, 1, greedy, seed)
            greedy_rewards.append(g["rewards_NK"])
            for prefix, call in (("", s), ("greedy/", g)):
                for name, value in call["user_metrics"].items():
                    user_metrics[prefix + name].append(value)
        metrics = {"loss": hf_eval_loss(batch_losses, len(rows), batch_size)}
        # TRL's `log()`: each metric's mean over the eval batches' values, NaN ones left out.
        for name, values in batch_metrics.items():
            values = [v for v in values if not math.isnan(v)]
            metrics[name] = float(np.mean(values)) if values else math.nan
        metrics["num_tokens"] = float(getattr(self, "_tokens_seen", 0))  # TRL: training's so far
        greedy_NK = np.concatenate(greedy_rewards)
        weighted = np.nansum(greedy_NK * self.reward_weights[None], axis=1)
        metrics["greedy/reward"] = float(np.mean(weighted))
        for i, name in enumerate(self.reward_func_names):
            column = greedy_NK[:, i]
            scored = column[~np.isnan(column)]
            metrics[f"greedy/rewards/{name}/mean"] = (
                float(scored.mean()) if scored.size else math.nan
            )
        for name, values in user_metrics.items():
            # TRL: each eval batch's mean, averaged over the batches (NaN ones left out).
            values = [v for v in values if not math.isnan(v)]
            metrics[name] = float(np.mean(values)) if values else math.nan
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        prep = getattr(self, "model_preparation_time", None)
        metrics.update(speed_metrics(metric_key_prefix, start_time, len(rows), batch_size, prep))
        # TRL's `log()` logs None for a metric with no non-NaN value (e.g. a reward function that
        # returned None for every eval completion); the returned metrics keep the NaN.
        self.log({k: None if math.isnan(v) else v for k, v in metrics.items()})
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def _eval_batch(self, policy: Any, s: dict, group_size: int) -> tuple[float, dict]:
        """TRL's `compute_loss` on one eval batch (a `_sample` call with `group_size`
        completions per prompt): advantages of the batch alone, the evaluated policy's log-probs
        as the old ones, the training loss function forward only. Returns the batch's loss and
        its metrics: the scoring ones (`reward`, `reward_std`, `rewards/<name>/*`,
        `frac_reward_zero_std`, RLOO's `kl`) and the loss's (`entropy`, GRPO's `kl`,
        `clip_ratio/*`, ...), as TRL appends them per eval batch."""
        rollout = self._rollout_rows(s)
        if self._kl_in_reward():  # RLOO's KL reward: TRL recomputes the policy's log-probs
            rollout["old_logps"] = self._jit_logps(policy, rollout)
        if self._needs_ref():
            rollout["ref_logps"] = self._jit_ref_logps(self.train_state, rollout)
        rollout["advantages"], metrics = self._advantages(s["rewards_NK"], rollout, group_size)
        self._record_completions(s, rollout["advantages"])  # TRL's eval batches log theirs too
        # No `old_logps` (ratio 1) and no `num_items_in_batch` (the loss normalises a
        # token-normalised type by the batch's own tokens, TRL's eval normaliser).
        rollout.pop("old_logps", None)
        batch_A = jax.tree.map(lambda x: x[None], rollout)  # one micro-batch
        aux = jax.device_get(self._jit_eval_step(self.train_state, batch_A))
        # The step's reductions (`reduce_aux`); the loss over its units as `loss_type` counts
        # them (at least 1).
        values = {k: float(v) for k, v in jax.device_get(reduce_aux(aux)).items()}
        loss = values.pop("loss")
        metrics.update(values)
        return loss, metrics
