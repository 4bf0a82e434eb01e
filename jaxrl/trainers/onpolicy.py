"""GRPO's and RLOO's shell on the one online loop (`jaxrl.trainers.online`, which PPO shares):
prompts -> sampler -> rewards -> advantages -> jitted update.

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

`OnPolicyTrainer` is composed of mixins, each in its own module, none of which imports this one:
`onpolicy_prompts` (prompt ids, lengths, sampling settings), `onpolicy_rewards` (reward
functions and their logging hooks), `onpolicy_batches` (`StepPlan`, `GenerationBatches`, sizes
and the train iterator), `onpolicy_logging` (completion metrics and logs, `log`) and
`onpolicy_evaluation` (`evaluate`). This module keeps the construction, the subclass hooks, the
train state and jitted steps, the rollout (sample, score, buffer) and the on-policy iteration.

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

import logging
import os
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import parallel
from jaxrl.algos import reference
from jaxrl.algos.rollout import (
    loss_mask,
    make_buffer_step,
    make_policy_logps,
    make_reference_logps,
    rollout_sampling_metrics,
)
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import ConfigError
from jaxrl.core.step import make_eval_step, make_train_step
from jaxrl.data import vision, vision_prompts
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.rewards import (
    RewardFunc,
    completions_from_texts,
    compute_rewards,
    resolve_reward_weights,
    reward_func_name,
)
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.environments import placeholder_dataset
from jaxrl.trainers.image_text import ImageTextMixin
from jaxrl.trainers.online import OnlineLoop
from jaxrl.trainers.onpolicy_agentic import OnPolicyAgenticMixin
from jaxrl.trainers.onpolicy_batches import OnPolicyBatchesMixin, StepPlan
from jaxrl.trainers.onpolicy_config import OnPolicyConfig
from jaxrl.trainers.onpolicy_evaluation import OnPolicyEvaluationMixin
from jaxrl.trainers.onpolicy_logging import CompletionLogsMixin
from jaxrl.trainers.onpolicy_prompts import PROMPT_IDS, OnPolicyPromptsMixin
from jaxrl.trainers.onpolicy_rewards import OnPolicyRewardsMixin
from jaxrl.trainers.unsupported import refuse as refuse_unsupported

logger = logging.getLogger("jaxrl")


class OnPolicyTrainer(
    OnPolicyPromptsMixin,
    OnPolicyRewardsMixin,
    OnPolicyBatchesMixin,
    CompletionLogsMixin,
    OnPolicyEvaluationMixin,
    OnPolicyAgenticMixin,
    ImageTextMixin,
    OnlineLoop,
    Trainer,
):
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
        tools: Sequence[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Callable | dict[str, Callable] | None = None,
        **unsupported: Any,
    ):
        refuse_unsupported(type(self).__name__, unsupported)
        args = args if args is not None else self.config_class(output_dir="trainer_output")
        if not isinstance(args, self.config_class):
            raise TypeError(f"args must be a {self.config_class.__name__}, got {type(args)}.")
        # TRL's prompt datasets with images (an `image` / `images` column, conversational
        # prompts): the model runs its vision tower, the processor makes the pixel values
        # (`jaxrl.data.vision_prompts`).
        if train_dataset is None and environment_factory is not None:
            # TRL: the environment owns the data (`reset()` returns each prompt).
            train_dataset = placeholder_dataset(environment_factory, args, jax.device_count())
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
        # Before `Trainer.__init__`: the prompts are tokenized with the tools.
        self._init_agentic(tools, rollout_func, environment_factory)
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
        self._check_agentic()
        env_rewards = self.environment_pool.reward_funcs if self.environment_pool else []
        if env_rewards and not reward_funcs:  # TRL: the environment owns the reward
            self.reward_funcs = []
        else:
            self.reward_funcs = self._load_reward_funcs(reward_funcs, reward_processing_classes)
        weights = resolve_reward_weights(a.reward_weights, len(self.reward_funcs))
        # TRL: an environment's `get_reward` is one more reward function (weight 1), named after
        # its class.
        self.reward_funcs += env_rewards
        self.reward_weights = np.concatenate([weights, np.ones(len(env_rewards), np.float32)])
        self.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
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
            return {reference.REF: self._frozen_copy(params)}
        if self._ref_is_initial_adapter:
            # An adapter-sized copy: the reference is base + the adapter as it was loaded.
            return {reference.REF_ADAPTER: jax.tree.map(jnp.copy, params)}
        # No second copy of the weights: the reference is the frozen base with the adapter
        # disabled (`jaxrl.algos.reference`).
        return reference.lora_base_frozen(params)

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
        self._jit_ref_logps = jax.jit(
            make_reference_logps(
                a, self.apply_model, peft=self.is_peft, initial_adapter=self._ref_is_initial_adapter
            )
        )
        # The training loss, forward only and without dropout (TRL evaluates in eval mode):
        # `evaluate()`'s per-batch `eval_loss`.
        self._jit_eval_step = jax.jit(make_eval_step(self._loss_fn()), out_shardings=repl)
        self.rollout_sampler = Sampler(
            self.graphdef, mesh=self.mesh, rules=self.rules, prompt_buckets=self._prompt_buckets(),
            engine=a.generation_engine, num_slots=a.generation_num_slots,
        )  # fmt: skip

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
        rows = [ex for ex in examples for _ in range(group_size)]
        pixel_values = None
        agentic: dict = {}
        if self._agentic:  # tools, environments or the user's rollout (`onpolicy_agentic`)
            agentic = self._agentic_generate(params, examples, group_size, config, seed)
            out, lengths_N, ids_list = agentic["out"], agentic["lengths_N"], agentic["ids"]
            prompts, completions = agentic["prompts"], agentic["completions"]
        else:
            prompt_ids = [ex[PROMPT_IDS] for ex in examples]
            has_images = self.vision and any(vision.example_images(ex) for ex in examples)
            if self.vision and self.max_images:
                pixel_values = self._prompt_images.pixel_values(
                    examples, prompt_ids, self.max_images
                )
            g = self._generate(
                prompt_ids, config, seed, group_size=group_size, params=params,
                pixel_values=pixel_values,
            )  # fmt: skip
            out, lengths_N, ids_list = g.out, g.lengths, g.ids
            prompts = [ex["prompt"] for ex in rows]
            if has_images:  # TRL: `prepare_multimodal_messages(prompt, images)` once any
                prompts = [
                    vision_prompts.prompt_messages(ex["prompt"], vision.example_images(ex))
                    for ex in rows
                ]
            completions = completions_from_texts(prompts, g.texts)
        truncated_N = self._truncated(ids_list, config)
        columns = {}
        if not self.args.remove_unused_columns:
            skip = ("prompt", PROMPT_IDS)
            columns = {k: [ex[k] for ex in rows] for k in examples[0] if k not in skip}
        elif self.vision:  # TRL's signature columns keep the images
            columns = {k: [ex[k] for ex in rows] for k in vision.IMAGE_COLUMNS if k in examples[0]}
        # TRL: rollout_func's other fields (one value per rollout, or one for all) and each
        # rollout's environment reach the reward functions.
        for key, values in agentic.get("extra", {}).items():
            columns[key] = list(values) if isinstance(values, list) else [values] * len(rows)
        if agentic.get("environments") is not None:
            columns["environments"] = agentic["environments"]
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
            completion_ids=ids_list,
            tool_mask_NC=agentic.get("tool_mask_NC"),
            tool_metrics=agentic.get("tool_metrics", {}),
        )

    def _truncated(self, ids_list: list[list[int]], config: GenerationConfig) -> np.ndarray:
        """`[N]` bool: the completion does not end with a stop id (EOS) or the pad token, i.e. it
        hit `max_completion_length` (TRL counts the pad token as a proper end too). A completion
        that `stop_strings` ended before its budget is not truncated: transformers pads such a
        row after the string, and that pad is the end TRL sees."""
        stop = {*config.stop_ids, self.tokenizer.pad_token_id}
        budget = config.max_new_tokens if config.stop_strings else 0
        return np.array(
            [not ids or (ids[-1] not in stop and len(ids) >= budget) for ids in ids_list],
            dtype=bool,
        )

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
        if s.get("tool_mask_NC") is not None:  # tool results: in the completion, out of the loss
            rows["tool_mask"] = jnp.asarray(s["tool_mask_NC"], completion_mask_NC.dtype)
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
        policy = self._sampling_params()
        s = self._sample(policy, plan.examples, G, self.rollout_generation_config, seed)
        out = s["out"]
        rollout = self._rollout_rows(s)
        loss_mask_NC = loss_mask(rollout)
        N = loss_mask_NC.shape[0]
        # TRL's `num_items_in_batch`: the generation batch's loss tokens (one copy per row, so
        # it travels with any slice of the buffer).
        rollout["num_items_in_batch"] = jnp.full(
            (N,), jnp.sum(loss_mask_NC, dtype=jnp.float32), jnp.float32
        )
        sampling_metrics = {}
        if self._needs_old_logps() or self._kl_in_reward():
            # Agentic rollouts: a forward, as TRL (a later turn's sampler log-probs do not
            # cover the tool tokens before it).
            if a.num_iterations > 1 or self._agentic:
                old = self._jit_logps(policy, rollout)
                if not self._agentic:  # the sampler's log-probs cover the whole completion
                    sampling_metrics = rollout_sampling_metrics(a, old, out.logprobs_BN, rollout)
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
        metrics.update(sampling_metrics)
        metrics.update(s["tool_metrics"])
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

    # ----------------------------------------------------------------- the on-policy iteration
    def _sampling_params(self) -> Any:
        # With LoRA the sampler runs base + adapter through the adapter forward (no merged copy
        # of the weights; see the module doc).
        return self.current_params()

    def _needs_rollout(self, plan: StepPlan) -> bool:
        return plan.starts_cycle or self._buffer_generation != plan.generation

    def _rollout(self, plan: StepPlan) -> None:
        self._generate_and_score(plan)

    def _update(self, plan: StepPlan, generated: bool) -> dict:
        if self.args.log_completions:  # this step logs the completions as they are now
            self._completion_logs_at[self.state.global_step + 1] = self._completion_logs_copy()
        slices_A = jnp.asarray(plan.slices, jnp.int32)
        self.train_state, metrics = self._jit_train_step(self.train_state, self.rollout, slices_A)
        # Generation metrics ride on every step of their cycle, so the window mean is TRL's mean
        # over generations; the token count only on the step that generated.
        metrics = {**metrics, **self._buffer_metrics}
        metrics["num_tokens"] = self._buffer_tokens if generated else 0.0
        return metrics
