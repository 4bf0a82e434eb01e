"""`PPOTrainer` with TRL v0.7.2's API: `step(queries, responses, scores, response_masks=None)`
runs one PPO step (rollout forward, rewards, GAE, the epochs x minibatches update) and returns
TRL's stats dict.

Host side here: input checks, padding, the response masks of TRL's `batched_forward_pass`,
stats formatting, the KL-controller update and logging. Everything that touches parameters is
jitted (`jaxrl.algos.ppo`): one forward pass of policy and reference over the rollout, then the
whole optimisation phase as one call with the train state donated.

Differences from TRL v0.7.2, all deliberate:
- `max_grad_norm` clips every optimizer update. TRL passes a one-shot `filter` iterator to
  `clip_grad_norm_`, so only its first update is ever clipped.
- `response_masks` are applied to the response tokens for left padding too (TRL offsets them
  wrongly when the batch is left-padded).
- Positions are `cumsum(attention_mask) - 1`; with right padding (the default) this equals what
  TRL's models used; with left padding transformers 4.36 used plain `arange` positions.
- The reference keeps only the LM (a value head is never needed for log-probs).
- `generate` returns NumPy int arrays (TRL: torch tensors) and samples with jaxrl's KV-cache
  `Sampler` from the current policy params.

LoRA (`peft_config=`, optionally over a `quantization_config` base; TRL v0.7.2 with a PEFT
policy): the adapter goes on the LM, the value head stays a full trainable layer, and the train
state's params (all the optimizer sees) are the adapter plus the value head; the base is frozen.
Without `ref_model` the reference is the policy's LM with the adapter disabled (TRL's
`optional_peft_ctx`), so there is no second copy of the weights; `generate` samples through the
adapter forward. `save_pretrained` writes TRL's PEFT layout: the adapter in PEFT's format plus
the value head alone in `model.safetensors`; `merged=True` writes the full value-head model. LoRA
dropout never fires, as in TRL v0.7.2 (its PPO forwards run in eval mode); nor does the model's
own dropout (GPT-2's pdrop rates, `jaxrl.models.dropout`) or the value head's summary dropout.

jaxrl addition: `train()` runs the common PPO loop (TRL's examples: for each batch of prompts,
generate, score, `step()`) as the iteration of the online shell GRPO and RLOO share
(`jaxrl.trainers.online.OnlineLoop`: rollout -> score -> update, on `TrainLoop`), so it logs to
`output_dir/metrics.jsonl` with TRL's stat names, checkpoints and resumes exactly (train state,
KL controller, score moments and the NumPy generator of the minibatch permutations) and saves
on SIGTERM. Its steps also log TRL's sampling-correction stats (`sampling/*`, as GRPO/RLOO):
the sampler's log-probs of the responses against `step()`'s `old_logprobs` (`ppo_train`).

This file is the trainer: the constructor, `step()` and the traced-call plumbing around it
(`train()`'s iteration: `ppo_train.PPOTrainLoopMixin`). What it shares with the other trainers comes from there (the loop,
checkpoints and resume: `TrainLoop`; the iteration and the sampler's completions: `OnlineLoop`;
where the reference lives in the train state: `jaxrl.algos.reference`; LoRA / QLoRA:
`model_setup.setup_peft`; the tokenizer: `TokenizerSetupMixin`); its TRL v0.7.2 host helpers
live beside it (`ppo_setup`: models and optimizer; `ppo_inputs`: dataloader and batches;
`ppo_stats`: stats; `ppo_generation`: `generate` and the reward; `ppo_export`: files). No traced
math here (`jaxrl.algos.ppo`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl import lora, seeding
from jaxrl.algos import ppo, reference
from jaxrl.algos.rollout import rollout_sampling_metrics
from jaxrl.core import rl
from jaxrl.core.state import TrainState
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.models.heads import CausalLMWithValueHead
from jaxrl.trainers import ppo_export, ppo_generation, ppo_inputs, ppo_setup, ppo_stats
from jaxrl.trainers.export import SaveModelMixin
from jaxrl.trainers.model_setup import setup_peft
from jaxrl.trainers.online import OnlineLoop
from jaxrl.trainers.ppo_config import PPOConfig
from jaxrl.trainers.ppo_train import PPOTrainLoopMixin
from jaxrl.trainers.tokenizer_setup import TokenizerSetupMixin


class PPOTrainer(TokenizerSetupMixin, SaveModelMixin, PPOTrainLoopMixin, OnlineLoop):
    """Proximal Policy Optimisation of a causal LM with a value head (TRL v0.7.2 API).

    `model`: a `CausalLMWithValueHead` or a path / Hub id (an HF directory, with or without
    TRL's `v_head.summary.*` keys). `ref_model`: None (a frozen copy of the policy LM), a path, a
    jaxrl causal LM or value-head model. `num_shared_layers` (only without `ref_model`): the
    policy's embeddings and first n layers are frozen (TRL's effective semantics; the reference
    stays a full frozen copy). `optimizer`: an optax transformation (default `adam(lr)`, torch
    Adam without weight decay); `lr_scheduler`: `ppo_step -> lr`, applied once per `step()` as
    TRL's `lr_scheduler.step()`; it needs an optimizer whose learning rate is injectable
    (`optax.inject_hyperparams`), which the default is. `ppo/learning_rate` is that injected
    rate (or `config.learning_rate` for a user optimizer without one).
    Minibatch order: each epoch draws `np.random.permutation(batch_size)` from NumPy's global
    generator, seeded with `config.seed` at construction, the same draws as TRL.
    `reward` (jaxrl, for `train()`): a callable `(prompts, completions) -> scores` on decoded
    texts (a None score counts as 0.0), or the path of a reward model trained by
    `RewardTrainer` (scores `prompt + completion + eos`, as it was trained).
    """

    _loss_metric = "ppo/loss/total"  # what train()'s TrainOutput.training_loss averages

    def __init__(
        self,
        config: PPOConfig | None = None,
        model: Any = None,
        ref_model: Any = None,
        tokenizer: Any = None,
        dataset: Any = None,
        optimizer: optax.GradientTransformation | None = None,
        data_collator: Callable | None = None,
        num_shared_layers: int | None = None,
        lr_scheduler: Callable[[jax.Array], jax.Array] | None = None,
        reward: Callable | str | os.PathLike | None = None,
        callbacks: list | None = None,
        peft_config: Any = None,
        quantization_config: Any = None,
    ):
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config must be a PPOConfig, got {type(config)}")
        self.args = config
        self._init_loop(callbacks)
        seeding.set_seed(config.seed)
        self.config = config
        config.world_size = jax.process_count()
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        config.is_encoder_decoder = False
        self.is_encoder_decoder = False

        self.model_path = str(model) if isinstance(model, str | os.PathLike) else None
        policy = ppo_setup.load_policy(model, config.seed)
        # LoRA on the policy's LM (TRL v0.7.2: `AutoModelForCausalLMWithValueHead` with a
        # `peft_config`); the value head stays a full trainable layer.
        self.lora_config = setup_peft(
            policy.pretrained_model,
            peft_config,
            quantization_config,
            seed=config.seed,
            task="CAUSAL_LM",
            trainer_name="PPOTrainer (a causal LM with a value head)",
        )
        self.is_peft = self.is_peft_model = self.lora_config is not None
        config.is_peft_model = self.is_peft_model
        self.processing_class = self._load_tokenizer(tokenizer)
        # LoRA without ref_model: the reference is the policy's LM with the adapter disabled.
        self._ref_is_base = self.is_peft_model and ref_model is None
        if self._ref_is_base and num_shared_layers is not None:
            raise ValueError(
                "num_shared_layers freezes layers of a full reference copy; with LoRA the "
                "reference is the frozen base itself (TRL ignores the option here). Drop it."
            )
        ref_lm = (
            None if self._ref_is_base else ppo_setup.reference(policy, ref_model, num_shared_layers)
        )

        self.dataset = dataset
        self.data_collator = data_collator
        self.dataloader = None
        if dataset is not None:
            self.dataloader = self.prepare_dataloader(dataset, data_collator)
        elif jax.process_count() > 1:
            warnings.warn(
                "No dataset is provided. In a multi-host setting every host must feed step() its "
                "share of queries itself.",
                UserWarning,
                stacklevel=2,
            )

        self.kl_ctl = (
            rl.adaptive_kl_controller(config.init_kl_coef, config.target, config.horizon)
            if config.adap_kl_ctrl
            else rl.fixed_kl_controller(config.init_kl_coef)
        )
        self.lr_scheduler = lr_scheduler
        self.lm_graphdef = nnx.graphdef(policy.pretrained_model)
        self._positions = policy.config.max_position_embeddings
        if self.is_peft_model:
            # Trained: the adapter and the value head; frozen: the base.
            self.graphdef, params, base = nnx.split(
                policy, nnx.Any(lora.ADAPTER, nnx.PathContains("v_head")), ...
            )
            frozen = {"base": base}
        else:
            self.graphdef, params = nnx.split(policy)
        if self._ref_is_base:
            self.ref_graphdef = self.lm_graphdef
            # modules_to_save params keep their initial values (`jaxrl.algos.reference`).
            frozen.update(reference.lora_base_frozen(params))
        else:
            self.ref_graphdef, ref_params = nnx.split(ref_lm)
            if ref_lm is policy.pretrained_model:  # frozen copy: the policy's buffers are donated
                ref_params = jax.tree.map(jnp.copy, ref_params)
            if not self.is_peft_model:
                frozen = {}
            frozen[reference.REF] = ref_params
        shared = num_shared_layers if ref_model is None else None
        self.tx = ppo_setup.make_tx(config, optimizer, params, shared, policy.config)
        extras = {
            "kl_ctl": self.kl_ctl.init(),
            "score_moments": rl.running_moments_init(),
            "ppo_step": jnp.zeros((), jnp.int32),
            # train() checkpoints NumPy's generator (the minibatch permutations) with the state.
            "numpy_rng": jnp.asarray(ppo_stats.numpy_rng_state()),
        }
        self.train_state = jax.jit(
            lambda p, f, e: TrainState.create(p, self.tx, seed=config.seed, frozen=f, extras=e)
        )(params, frozen, extras)
        hyper = ppo_stats.learning_rate_hyperparams(self.train_state.opt_state)
        if lr_scheduler is not None and not hyper:
            raise ValueError(
                "lr_scheduler needs an optimizer with an injectable learning rate: build it as "
                "optax.inject_hyperparams(optax.adam)(learning_rate=...)."
            )
        self._compile()
        self.current_step = 0
        self.log_history: list[dict] = []
        engine = dict(engine=config.generation_engine, num_slots=config.generation_num_slots)
        self.rollout_sampler = Sampler(self.lm_graphdef, **engine)
        self._ref_sampler = (
            ppo_generation.AdapterOffSampler(self.lm_graphdef, **engine)
            if self._ref_is_base
            else Sampler(self.ref_graphdef, **engine)
        )
        self._generate_calls = 0
        self.reward = ppo_generation.build_reward(reward, self.tokenizer)

    def _load_tokenizer(self, processing_class: Any) -> Any:
        """TRL v0.7.2: the tokenizer given, or the model directory's; it must have a pad token
        (v0.7.2 refuses one without, where TRL's current trainers pad with the EOS)."""
        if processing_class is None:
            if self.model_path is None:
                raise ValueError("tokenizer is required when model is not a path.")
            processing_class = self._default_processing_class()
        if getattr(processing_class, "pad_token_id", None) is None:
            raise ValueError(
                "The tokenizer has no pad token; set one (e.g. tokenizer.pad_token = "
                "tokenizer.eos_token), as TRL's collator needs it to pad queries + responses."
            )
        return super()._load_tokenizer(processing_class)

    def _compile(self) -> None:
        c = self.config
        apply_policy = lambda p: nnx.merge(self.graphdef, p)  # noqa: E731
        if self._ref_is_base:
            # The rollout's ref params are the policy's LM params (adapter included), run with
            # every adapter branch skipped.
            apply_ref = lambda p: lora.without_adapter(nnx.merge(self.ref_graphdef, p))  # noqa: E731
        else:
            apply_ref = lambda p: nnx.merge(self.ref_graphdef, p)  # noqa: E731
        self._jit_rollout = jax.jit(ppo.make_rollout(c, apply_policy, apply_ref))
        self._jit_rewards = jax.jit(ppo.make_rewards(c))
        self._jit_advantages = jax.jit(ppo.make_advantages(c))
        loss_fn = ppo.make_loss(c, apply_policy, peft=self.is_peft_model)
        optimise = ppo.make_optimise(c, loss_fn, self.tx, self.lr_scheduler)
        self._jit_optimise = jax.jit(optimise, donate_argnums=0)

    # ------------------------------------------------------------------ public API
    def _policy_params(self) -> Any:
        """The whole policy's state (with LoRA: adapter + value head and the frozen base)."""
        state = self.train_state
        if self.is_peft_model:
            return nnx.merge_state(state.params, state.frozen["base"])
        return state.params

    def _ref_params(self) -> Any:
        """The reference LM's params: the frozen copy, or with LoRA and no `ref_model` the
        policy's LM params (run with the adapter disabled; initial modules_to_save values)."""
        state = self.train_state
        if not self._ref_is_base:
            return state.frozen[reference.REF]
        return reference.lora_base_adapter(self._policy_params(), state.frozen)["pretrained_model"]

    @property
    def model(self) -> CausalLMWithValueHead:
        """The policy bound to the current params (rebuilt after each step: the state is
        donated, so do not keep it across `step()` calls)."""
        return nnx.merge(self.graphdef, self._policy_params())

    @property
    def ref_model(self) -> Any:
        """The frozen reference LM; None with LoRA and no `ref_model` (as TRL: the reference is
        the policy's LM with the adapter disabled)."""
        if self._ref_is_base:
            return None
        return nnx.merge(self.ref_graphdef, self.train_state.frozen[reference.REF])

    @property
    def kl_coef(self) -> float:
        """The KL coefficient the next `step()` uses (TRL `kl_ctl.value`)."""
        return float(self.train_state.extras["kl_ctl"].value)

    def prepare_dataloader(self, dataset: Any, data_collator: Callable | None = None):
        """TRL's dataloader: shuffled batches of `config.batch_size` rows, last partial batch
        dropped, columns the model does not use removed (`remove_unused_columns`).
        `data_collator` receives the list of row dicts; the default returns a dict of lists
        (what TRL's examples pass as `collator`)."""
        if isinstance(dataset, datasets.Dataset) and self.config.remove_unused_columns:
            unused = [c for c in dataset.column_names if c not in ppo_inputs.SIGNATURE_COLUMNS]
            dataset = dataset.remove_columns(unused)
        iterator = ppo_inputs.prompt_batches(
            dataset, self.config.batch_size, self.config.seed, data_collator
        )
        return ppo_inputs.EpochLoader(iterator)

    def _step_safety_checker(self, batch_size, queries, responses, scores, masks=None):
        return ppo_inputs.check_step_inputs(batch_size, queries, responses, scores, masks)

    def prepare_model_inputs(self, queries: Sequence, responses: Sequence) -> dict[str, np.ndarray]:
        """`input_ids` (query + response, padded with the tokenizer's pad id on its padding
        side) and `attention_mask`, as TRL's `DataCollatorForLanguageModeling` makes them."""
        return ppo_inputs.model_inputs(
            queries,
            responses,
            self.tokenizer.pad_token_id,
            getattr(self.tokenizer, "padding_side", "right"),
            self.config.pad_to_multiple_of,
        )

    _response_mask = staticmethod(ppo_inputs.response_mask)

    def step(
        self,
        queries: list,
        responses: list,
        scores: list,
        response_masks: list | None = None,
    ) -> dict[str, Any]:
        """One PPO step on a batch of `config.batch_size` (query, response, score) triples;
        returns TRL's stats (see `record_step_stats`, plus `ppo/learning_rate` and `time/ppo/*`)."""
        return self._step(queries, responses, scores, response_masks)

    def _step(
        self,
        queries: list,
        responses: list,
        scores: list,
        response_masks: list | None = None,
        sampling_logprobs: list | None = None,
    ) -> dict[str, Any]:
        """`step()`; with `sampling_logprobs` (the sampler's log-prob of each response token,
        `train()`'s rollouts) also TRL's sampling-correction stats (`sampling/*`) of them
        against the rollout forward's `old_logprobs`, over the response tokens."""
        c = self.config
        queries, responses, scores_B, response_masks = self._step_safety_checker(
            c.batch_size, queries, responses, scores, response_masks
        )
        timing = {}
        t0 = time.time()
        t = time.time()
        inputs = self.prepare_model_inputs(queries, responses)
        mask_BT = jnp.asarray(
            self._response_mask(queries, responses, inputs["attention_mask"], response_masks)
        )
        state = self.train_state
        fwd = self._jit_rollout(
            self._policy_params(), self._ref_params(), inputs["input_ids"], inputs["attention_mask"]
        )
        jax.block_until_ready(fwd)
        timing["time/ppo/forward_pass"] = time.time() - t
        sampling_stats = {}
        if sampling_logprobs is not None:
            sampling_BT = ppo_inputs.response_values(
                queries, responses, inputs["attention_mask"], sampling_logprobs
            )
            sampling_stats = rollout_sampling_metrics(
                c, fwd["logprobs"], jnp.asarray(sampling_BT), {"completion_mask": mask_BT}
            )

        t = time.time()
        kl_coef = state.extras["kl_ctl"].value
        kl_coef_used = float(kl_coef)  # read now: the state is donated to the update below
        scores_B, moments, rewards_BT, non_score_BT = self._jit_rewards(
            jnp.asarray(scores_B), state.extras["score_moments"], fwd["kl"], mask_BT, kl_coef
        )
        jax.block_until_ready(rewards_BT)
        timing["time/ppo/compute_rewards"] = time.time() - t
        t = time.time()
        values_BT, advantages_BT, returns_BT = self._jit_advantages(
            fwd["values"], rewards_BT, mask_BT
        )
        jax.block_until_ready(returns_BT)
        timing["time/ppo/compute_advantages"] = time.time() - t

        t = time.time()
        rollout = {
            "input_ids": jnp.asarray(inputs["input_ids"]),
            "attention_mask": jnp.asarray(inputs["attention_mask"]),
            "old_logprobs": fwd["logprobs"],
            "values": values_BT,
            "mask": mask_BT,
            "advantages": advantages_BT,
            "returns": returns_BT,
        }
        # TRL draws one permutation per epoch it runs from NumPy's global generator; we draw
        # all epochs up front and afterwards rewind to consume exactly as many as ran.
        rng_state = np.random.get_state()
        perms = np.stack([np.random.permutation(c.batch_size) for _ in range(c.ppo_epochs)])
        lr_used = self._current_learning_rate()
        self.train_state = self.train_state.replace(
            extras={**state.extras, "score_moments": moments}
        )
        self.train_state, out = self._jit_optimise(
            self.train_state, rollout, jnp.asarray(perms, jnp.int32)
        )
        out = jax.device_get(out)
        timing["time/ppo/optimize_step"] = time.time() - t
        np.random.set_state(rng_state)
        for _ in range(int(np.sum(out["epoch_ran"]))):
            np.random.permutation(c.batch_size)

        t = time.time()
        train_stats = ppo_stats.train_stats(out, c.ratio_threshold)
        stats = self.record_step_stats(
            kl_coef=kl_coef_used,
            scores=np.asarray(scores_B),
            logprobs=np.asarray(fwd["logprobs"]),
            ref_logprobs=np.asarray(fwd["ref_logprobs"]),
            non_score_reward=np.asarray(non_score_BT),
            train_stats=train_stats,
            masks=np.asarray(mask_BT),
            queries=queries,
            responses=responses,
        )
        timing["time/ppo/calc_stats"] = time.time() - t
        stats["ppo/learning_rate"] = lr_used
        stats.update(sampling_stats)
        extras = dict(self.train_state.extras)
        extras["kl_ctl"] = self.kl_ctl.update(
            extras["kl_ctl"], stats["objective/kl"], c.batch_size * jax.process_count()
        )
        extras["ppo_step"] = extras["ppo_step"] + 1
        self.train_state = self.train_state.replace(extras=extras)
        timing["time/ppo/total"] = time.time() - t0
        stats.update(timing)
        if c.log_with != "wandb":
            stats = {k: ppo_stats.to_scalar(v) for k, v in stats.items()}
        return stats

    def _current_learning_rate(self) -> float:
        hyper = ppo_stats.learning_rate_hyperparams(self.train_state.opt_state)
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler(self.train_state.extras["ppo_step"]))
        if hyper:
            return float(hyper[0].hyperparams["learning_rate"])
        return float(self.config.learning_rate)

    def record_step_stats(self, kl_coef: float, **data: Any) -> dict[str, Any]:
        """TRL's step statistics from the rollout and the per-mini-batch train stats."""
        return ppo_stats.record_step_stats(kl_coef, **data)

    def compute_rewards(
        self, scores: Any, logprobs: Any, ref_logprobs: Any, masks: Any
    ) -> tuple[jax.Array, jax.Array]:
        """Per-token `(rewards, non_score_reward)` with the current KL coefficient and
        `config.kl_penalty` (for "full", `logprobs`/`ref_logprobs` are full log-softmax
        `[B, T, V]`, as in TRL)."""
        kl = rl.kl_penalty(jnp.asarray(logprobs), jnp.asarray(ref_logprobs), self.config.kl_penalty)
        return rl.compute_rewards(
            jnp.asarray(scores), kl, jnp.asarray(masks), self.train_state.extras["kl_ctl"].value
        )

    def compute_advantages(
        self, values: Any, rewards: Any, mask: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(values, advantages, returns)`: masked GAE with whitened advantages (TRL)."""
        return self._jit_advantages(jnp.asarray(values), jnp.asarray(rewards), jnp.asarray(mask))

    def loss(
        self,
        old_logprobs: Any,
        values: Any,
        logits: Any,
        vpreds: Any,
        logprobs: Any,
        mask: Any,
        advantages: Any,
        returns: Any,
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """TRL's `loss`: `(pg_loss, vf_coef * vf_loss, stats)` of one mini-batch."""
        return ppo.policy_and_value_loss(
            self.config, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns
        )

    def batched_forward_pass(
        self,
        model: Any,
        queries: list,
        responses: list,
        model_inputs: dict,
        return_logits: bool = False,
        response_masks: list | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array]:
        """TRL's `(logprobs, logits or None, values, masks)`, all `[B, L - 1, ...]`, for a
        value-head model (values) or a plain causal LM (values None). Full logits only with
        `return_logits` (TRL's API); log-probs are computed without them."""
        ids = jnp.asarray(model_inputs["input_ids"])
        attn = jnp.asarray(model_inputs["attention_mask"])
        queries = [ppo_inputs.as_1d_ints(q, "queries") for q in queries]
        responses = [ppo_inputs.as_1d_ints(r, "responses") for r in responses]
        rmasks = None if response_masks is None else [np.asarray(m) for m in response_masks]
        masks = jnp.asarray(self._response_mask(queries, responses, np.asarray(attn), rmasks))
        graphdef, state = nnx.split(model)
        logps, logits, values = ppo.batched_forward(graphdef, state, ids, attn, return_logits)
        return logps, logits, values, masks

    def log_stats(
        self,
        stats: dict,
        batch: dict,
        rewards: Any,
        columns_to_log: Sequence[str] = ("query", "response"),
    ) -> dict[str, Any]:
        """Add `env/reward_mean`, `env/reward_std` (unbiased) and `env/reward_dist` to `stats`,
        record them in `log_history`, and send them to wandb with `log_with="wandb"` (with the
        `game_log` table of `columns_to_log` and rewards). Only process 0 logs; returns the logs."""
        rewards = ppo_stats.as_rewards(rewards)
        if jax.process_index() != 0:
            return {}
        logs = dict(stats)
        if "query" not in batch and "response" not in batch:
            warnings.warn(
                "The game logs will not be logged because the batch does not contain the keys "
                "'query' and 'response'.",
                UserWarning,
                stacklevel=2,
            )
        elif self.config.log_with == "wandb":
            import wandb

            missing = [c for c in columns_to_log if c not in batch]
            if missing:
                raise ValueError(f"Columns to log {missing} are not present in the batch.")
            rows = [
                list(r)
                for r in zip(*[batch[c] for c in columns_to_log], rewards.tolist(), strict=True)
            ]
            logs["game_log"] = wandb.Table(columns=[*columns_to_log, "reward"], rows=rows)
        logs.update(ppo_stats.reward_logs(rewards))
        self.log_history.append({k: v for k, v in logs.items() if k != "game_log"})
        if self.config.log_with == "wandb":
            import wandb

            if wandb.run is None:
                wandb.init(
                    project=self.config.tracker_project_name,
                    config={"trl_ppo_trainer_config": self.config.to_dict()},
                    **self.config.tracker_kwargs.get("wandb", {}),
                )
            wandb.log(logs)
        return logs

    # ------------------------------------------------------------------ generation
    def generation_config(self, **generation_kwargs: Any) -> GenerationConfig:
        """A `GenerationConfig` from transformers `generate` keyword arguments (defaults:
        transformers', with the tokenizer's EOS/pad ids and `max_new_tokens=response_length`;
        see `ppo_generation.generation_config`)."""
        return ppo_generation.generation_config(
            generation_kwargs, self.config.response_length, self.tokenizer
        )

    def _sample(
        self, queries: list[np.ndarray], gen: GenerationConfig, key: jax.Array, ref: bool = False
    ) -> list[np.ndarray]:
        """Completions of `queries` from the current policy (or the reference) params, without
        padding: each ends at its first EOS or stop string (kept) or after `max_new_tokens`."""
        if ref:
            out = self._ref_sampler(
                self._ref_params(), queries, gen, seed=key, tokenizer=self.tokenizer
            )
            ids_BN, mask_BN = jax.device_get((out.completion_ids_BN, out.completion_mask_BN))
            lengths = mask_BN.sum(axis=1)
            return [ids_BN[i, : int(lengths[i])].astype(np.int64) for i in range(len(queries))]
        g = self._generate(queries, gen, key, decode=False)
        return [np.asarray(ids, np.int64) for ids in g.ids]

    def _finish(self, query: np.ndarray, completion: np.ndarray, return_prompt: bool):
        return ppo_generation.remove_padding(
            query, completion, return_prompt, self.tokenizer.eos_token_id
        )

    def generate(
        self,
        query_tensor: Any,
        length_sampler: Callable[[], int] | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        **generation_kwargs: Any,
    ) -> Any:
        """TRL's `generate`: a 1-D query gives a `[1, L]` array; a list of queries gives a list
        of 1-D arrays, generated in chunks of `batch_size` (left-padded, one `length_sampler()`
        draw of `max_new_tokens` per chunk), padding stripped and cut after the first EOS.
        `return_prompt=False` drops the query. `generate_ref_response=True` also samples the
        reference model (same keys) and returns `(responses, ref_responses)`.
        `generation_kwargs`: transformers names (see `generation_config`)."""
        self._generate_calls += 1
        key = jax.random.fold_in(jax.random.key(self.config.seed), self._generate_calls)
        if isinstance(query_tensor, list):
            queries = [ppo_inputs.as_1d_ints(q, "query_tensor") for q in query_tensor]
            chunk = min(len(queries), batch_size)
        else:
            arr = np.asarray(
                query_tensor.detach().cpu() if hasattr(query_tensor, "detach") else query_tensor
            )
            if arr.ndim != 1:
                raise ValueError(
                    f"query_tensor must be a 1-D tensor or a list of them, got shape {arr.shape}."
                )
            queries, chunk = [arr.astype(np.int64)], 1
        outs: list[list[np.ndarray]] = [[], []]
        for i in range(0, len(queries), chunk):
            kw = dict(generation_kwargs)
            if length_sampler is not None:
                kw["max_new_tokens"] = int(length_sampler())
            gen = self.generation_config(**kw)
            part = queries[i : i + chunk]
            chunk_key = jax.random.fold_in(key, i)
            for j, ref in enumerate((False, True)[: 1 + bool(generate_ref_response)]):
                for q, c in zip(part, self._sample(part, gen, chunk_key, ref), strict=True):
                    outs[j].append(self._finish(q, c, return_prompt))
        if not isinstance(query_tensor, list):
            outs = [[o[0][None]] if o else [] for o in outs]
            outs = [o[0] if o else None for o in outs]
        return (outs[0], outs[1]) if generate_ref_response else outs[0]

    def save_pretrained(self, save_directory: str | Path, merged: bool = False) -> None:
        """Policy, tokenizer and model card in TRL v0.7.2's layout (`ppo_export.save_policy`:
        LM + value head; with LoRA the PEFT adapter + the value head alone, or `merged=True`
        the full value-head model with the adapter folded in). `save_model` (default
        `output_dir/final`) writes the same files."""
        self.save_model(str(save_directory), merged=merged)

    def _save_weights(self, out: str, merged: bool) -> None:
        ppo_export.save_policy(
            self.model, out, is_peft=self.is_peft_model, model_path=self.model_path, merged=merged
        )

    def _save_metadata(self, out: str, merged: bool) -> None:
        self.create_model_card(out)

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write `README.md` (TRL v0.7.2's card; `ppo_export.write_model_card`)."""
        ppo_export.write_model_card(path, model_name)
