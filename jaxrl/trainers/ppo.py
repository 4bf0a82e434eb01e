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
generate, score, `step()`) on `TrainLoop`, so it logs to `output_dir/metrics.jsonl` with TRL's
stat names, checkpoints and resumes exactly (train state, KL controller, score moments and the
NumPy generator of the minibatch permutations) and saves on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl import lora
from jaxrl.algos import ppo
from jaxrl.core import rl
from jaxrl.core.state import TrainState
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.lora.value_head import AutoModelForCausalLMWithValueHead
from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.heads import CausalLMWithValueHead
from jaxrl.models.hf import from_pretrained, save_pretrained
from jaxrl.seeding import set_seed
from jaxrl.trainers.loop import TrainLoop
from jaxrl.trainers.ppo_config import PPOConfig

WANDB_PADDING = -1  # TRL's fill value for NaN advantages in the logged arrays
# Columns TRL keeps with remove_unused_columns: the value-head model's forward arguments
# (input_ids, past_key_values, attention_mask) plus its logging columns.
SIGNATURE_COLUMNS = ("input_ids", "past_key_values", "attention_mask", "label", "query", "response")
# transformers `generate` keyword arguments that map onto jaxrl's GenerationConfig.
GENERATION_KWARGS = (
    "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "eos_token_id", "pad_token_id",
)  # fmt: skip
# Scalar stats step() returns that train() logs besides TRL's (jaxrl additions).
TRAIN_TIMINGS = ("time/ppo/generate", "time/ppo/score")

MODEL_CARD_TEMPLATE = """---
license: apache-2.0
tags:
- trl
- jaxrl
- reinforcement-learning
---

# {model_name}

This is a language model fine-tuned with reinforcement learning (PPO) using jaxrl, a JAX port of
[TRL](https://github.com/huggingface/trl), to guide the model outputs according to a value,
function, or human feedback. The model can be used for text generation.

## Usage

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}")
outputs = generator("Hello, my llama is cute")
```

To get the value-head outputs as well, load it with
`trl.AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")` or
`jaxrl.AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")`.
"""


def _as_1d_ints(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)
    if arr.ndim != 1:
        raise ValueError(
            f"Each element of {name} must be a 1-D token tensor, got shape {arr.shape}."
        )
    return arr.astype(np.int64)


def _learning_rate_hyperparams(opt_state: Any) -> list[Any]:
    """The `inject_hyperparams` states in `opt_state` that expose a `learning_rate`."""
    found = []

    def visit(node):
        if hasattr(node, "hyperparams") and "learning_rate" in node.hyperparams:
            found.append(node)
        elif isinstance(node, tuple | list):
            for child in node:
                visit(child)

    visit(opt_state)
    return found


def _masked_updates(mask: Any) -> optax.GradientTransformation:
    """Multiply updates by a 0/1 tree (frozen shared layers get exactly zero change)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, m: u * m.astype(u.dtype), updates, mask), state

    return optax.GradientTransformation(init, update)


def _trainable_mask(params: Any, num_shared_layers: int | None, model_config: Any) -> Any:
    """1/0 per param element: 0 for the embeddings and the first `num_shared_layers`
    layers (TRL freezes every parameter before the first one of layer n)."""
    if num_shared_layers is None:
        return None
    num_layers = model_config.num_layers
    if not 0 <= num_shared_layers < num_layers:
        raise ValueError(
            f"num_shared_layers={num_shared_layers} has no layer to start the unshared part "
            f"(the model has {num_layers} layers): TRL's layer pattern could not be matched."
        )
    scan = model_config.scan_layers

    def leaf_mask(path, x):
        names = [getattr(p, "key", getattr(p, "idx", getattr(p, "name", p))) for p in path]
        names = [n for n in names if n != "value"]
        if names[0] != "pretrained_model":
            return jnp.ones((), jnp.float32)  # the value head comes after every layer
        if any(n in ("wte", "wpe", "embed_tokens") for n in names):
            return jnp.zeros((), jnp.float32)
        for i, n in enumerate(names):
            if n in ("h", "layers") and i + 1 < len(names):
                if scan:  # stacked layers: a per-layer row mask
                    rows = (jnp.arange(x.shape[0]) >= num_shared_layers).astype(jnp.float32)
                    return rows.reshape(-1, *([1] * (x.ndim - 1)))
                return jnp.asarray(float(int(names[i + 1]) >= num_shared_layers))
        return jnp.ones((), jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf_mask, params)


class _EpochLoader:
    """TRL's dataloader contract: `for batch in loader` is one shuffled epoch of full batches
    (`drop_last`), a new order each epoch; `len(loader)` is the batches per epoch."""

    def __init__(self, iterator: Any):
        self._it = iterator

    def __len__(self) -> int:
        return self._it.steps_per_epoch

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self._it)


class PPOTrainer(TrainLoop):
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

        set_seed(config.seed)
        self.config = config
        config.world_size = jax.process_count()
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        config.is_encoder_decoder = False
        self.is_encoder_decoder = False

        self.model_path = str(model) if isinstance(model, str | os.PathLike) else None
        policy = self._load_policy(model)
        self._setup_peft(policy, peft_config, quantization_config)
        config.is_peft_model = self.is_peft_model
        self.tokenizer = self._load_tokenizer(tokenizer, self.model_path)
        # LoRA without ref_model: the reference is the policy's LM with the adapter disabled.
        self._ref_is_base = self.is_peft_model and ref_model is None
        if self._ref_is_base and num_shared_layers is not None:
            raise ValueError(
                "num_shared_layers freezes layers of a full reference copy; with LoRA the "
                "reference is the frozen base itself (TRL ignores the option here). Drop it."
            )
        ref_lm = (
            None if self._ref_is_base else self._reference(policy, ref_model, num_shared_layers)
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
            # modules_to_save params are trained in full: the reference keeps their initial
            # values (PEFT's disable_adapter() runs the original modules).
            saved = nnx.filter_state(params, lora.SavedParam)
            if jax.tree.leaves(saved):
                frozen["ref_saved"] = jax.tree.map(jnp.copy, saved)
        else:
            self.ref_graphdef, ref_params = nnx.split(ref_lm)
            if ref_lm is policy.pretrained_model:  # frozen copy: the policy's buffers are donated
                ref_params = jax.tree.map(jnp.copy, ref_params)
            if not self.is_peft_model:
                frozen = {}
            frozen["ref"] = ref_params
        shared = num_shared_layers if ref_model is None else None
        self.tx = self._make_tx(optimizer, params, shared, policy.config)
        extras = {
            "kl_ctl": self.kl_ctl.init(),
            "score_moments": rl.running_moments_init(),
            "ppo_step": jnp.zeros((), jnp.int32),
            # train() checkpoints NumPy's generator (the minibatch permutations) with the state.
            "numpy_rng": jnp.asarray(_numpy_rng_state()),
        }
        self.train_state = jax.jit(
            lambda p, f, e: TrainState.create(p, self.tx, seed=config.seed, frozen=f, extras=e)
        )(params, frozen, extras)
        if lr_scheduler is not None and not _learning_rate_hyperparams(self.train_state.opt_state):
            raise ValueError(
                "lr_scheduler needs an optimizer with an injectable learning rate: build it as "
                "optax.inject_hyperparams(optax.adam)(learning_rate=...)."
            )
        self._compile()
        self.current_step = 0
        self.log_history: list[dict] = []
        self.processing_class = self.tokenizer
        self._sampler = Sampler(self.lm_graphdef)
        self._ref_sampler = (
            _AdapterOffSampler(self.lm_graphdef)
            if self._ref_is_base
            else Sampler(self.ref_graphdef)
        )
        self._generate_calls = 0
        self.reward = self._build_reward(reward)

    # ------------------------------------------------------------------ setup
    def _load_policy(self, model: Any) -> CausalLMWithValueHead:
        if isinstance(model, str | os.PathLike):
            return AutoModelForCausalLMWithValueHead.from_pretrained(model, seed=self.config.seed)
        if isinstance(model, CausalLMWithValueHead):
            return model
        raise ValueError(
            "model must be a jaxrl CausalLMWithValueHead or a path / Hub id of an HF causal LM "
            f"(value head keys optional), got {type(model).__name__}. Load one with "
            "jaxrl.AutoModelForCausalLMWithValueHead.from_pretrained(...)."
        )

    def _setup_peft(
        self, policy: CausalLMWithValueHead, peft_config: Any, quantization_config: Any
    ) -> None:
        """LoRA on the policy's LM (TRL v0.7.2: `AutoModelForCausalLMWithValueHead` with a
        `peft_config`), optionally over a quantized base (QLoRA). An LM that already carries
        adapters (`lora.load_peft_adapter`) trains them as is."""
        from jaxrl.trainers.base import _quantization_scheme

        lm = policy.pretrained_model
        scheme = _quantization_scheme(quantization_config)
        if peft_config is not None:
            if getattr(lm, "lora_config", None) is not None:
                raise ValueError(
                    "The model already has LoRA adapters and peft_config was given too; merge the "
                    "adapters first (lora.merge_lora) or drop peft_config."
                )
            cfg = peft_config
            if not isinstance(cfg, lora.LoraConfig):
                cfg = lora.LoraConfig.from_peft(peft_config)
            if cfg.task_type not in (None, "CAUSAL_LM"):
                raise ValueError(
                    f"peft_config.task_type={cfg.task_type!r} does not fit PPOTrainer (a causal "
                    "LM with a value head); use 'CAUSAL_LM'."
                )
            cfg = dataclasses.replace(cfg, task_type="CAUSAL_LM")
            lora.apply_lora(lm, cfg, nnx.Rngs(self.config.seed))
        self.lora_config = getattr(lm, "lora_config", None)
        self.is_peft_model = self.lora_config is not None
        if scheme is not None:
            if not self.is_peft_model:
                raise ValueError(
                    "quantization_config needs peft_config: a quantized base cannot be trained in "
                    "full, only LoRA adapters on top of it (QLoRA)."
                )
            lora.quantize_base(lm, scheme)

    def _load_tokenizer(self, tokenizer: Any, model_path: str | None) -> Any:
        if tokenizer is None:
            if model_path is None:
                raise ValueError("tokenizer is required when model is not a path.")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "The tokenizer has no pad token; set one (e.g. tokenizer.pad_token = "
                "tokenizer.eos_token), as TRL's collator needs it to pad queries + responses."
            )
        return tokenizer

    def _reference(self, policy: CausalLMWithValueHead, ref_model: Any, num_shared_layers):
        if ref_model is None:
            return policy.pretrained_model
        if num_shared_layers is not None:
            warnings.warn(
                "num_shared_layers is ignored when ref_model is provided. Two different models "
                "are used for the model and the reference model and no layers are shared.",
                UserWarning,
                stacklevel=3,
            )
        if isinstance(ref_model, str | os.PathLike):
            return from_pretrained(ref_model)
        if isinstance(ref_model, CausalLMWithValueHead):
            return ref_model.pretrained_model
        if isinstance(ref_model, CausalLM):
            return ref_model
        raise ValueError(
            "ref_model must be None, a path, or a jaxrl causal LM / CausalLMWithValueHead, got "
            f"{type(ref_model).__name__}."
        )

    def _make_tx(
        self, optimizer, params, num_shared_layers, model_config
    ) -> optax.GradientTransformation:
        c = self.config
        inner = (
            optimizer
            if optimizer is not None
            else optax.inject_hyperparams(optax.adam)(learning_rate=c.learning_rate)
        )
        parts = []
        mask = _trainable_mask(params, num_shared_layers, model_config)
        if mask is not None:
            parts.append(_masked_updates(mask))
        if c.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(c.max_grad_norm))
        parts.append(inner)
        if mask is not None:  # also after: a user optimizer may decay weights
            parts.append(_masked_updates(mask))
        return optax.chain(*parts)

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
            return state.frozen["ref"]
        params = self._policy_params()
        if "ref_saved" in state.frozen:
            params = nnx.merge_state(params, state.frozen["ref_saved"])
        return params["pretrained_model"]

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
        return nnx.merge(self.ref_graphdef, self.train_state.frozen["ref"])

    @property
    def kl_coef(self) -> float:
        """The KL coefficient the next `step()` uses (TRL `kl_ctl.value`)."""
        return float(self.train_state.extras["kl_ctl"].value)

    def prepare_dataloader(self, dataset: Any, data_collator: Callable | None = None):
        """TRL's dataloader: shuffled batches of `config.batch_size` rows, last partial batch
        dropped, columns the model does not use removed (`remove_unused_columns`).
        `data_collator` receives the list of row dicts; the default returns a dict of lists
        (what TRL's examples pass as `collator`)."""
        import datasets

        from jaxrl.data.batching import BatchIterator

        if isinstance(dataset, datasets.Dataset) and self.config.remove_unused_columns:
            unused = [c for c in dataset.column_names if c not in SIGNATURE_COLUMNS]
            dataset = dataset.remove_columns(unused)

        def dict_of_lists(rows: list[dict]) -> dict[str, list]:
            return {k: [r[k] for r in rows] for k in rows[0]}

        iterator = BatchIterator(
            dataset,
            global_batch_size=self.config.batch_size * jax.process_count(),
            seed=self.config.seed,
            collate_fn=data_collator or dict_of_lists,
            shuffle=True,
            drop_last=True,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        return _EpochLoader(iterator)

    def _step_safety_checker(self, batch_size, queries, responses, scores, masks=None):
        for name, seq in (("queries", queries), ("responses", responses), ("scores", scores)):
            if not isinstance(seq, list):
                raise ValueError(f"{name} must be a list of tensors - got {type(seq)}")
            if batch_size is not None and len(seq) != batch_size:
                raise ValueError(
                    f"Batch size ({batch_size}) does not match number of examples - but got "
                    f"{len(seq)} for: {name}"
                )
        queries = [_as_1d_ints(q, "queries") for q in queries]
        responses = [_as_1d_ints(r, "responses") for r in responses]
        flat_scores = []
        for s in scores:
            arr = np.asarray(s.detach().cpu() if hasattr(s, "detach") else s, np.float32)
            if arr.ndim > 1:
                raise ValueError(f"Scores must be 1-dimensional - got {arr.ndim} for {s}")
            if arr.size != 1:
                raise ValueError(f"Each score must hold one value, got {arr.size} for {s}")
            flat_scores.append(arr.reshape(()))
        if masks is not None:
            if not isinstance(masks, list) or len(masks) != len(responses):
                raise ValueError("response_masks must be a list with one mask per response.")
            masks = [_as_1d_ints(m, "response_masks") for m in masks]
            for m, r in zip(masks, responses, strict=True):
                if len(m) != len(r):
                    raise ValueError(
                        f"A response mask has length {len(m)} but its response has {len(r)}."
                    )
        return queries, responses, np.stack(flat_scores), masks

    def prepare_model_inputs(self, queries: Sequence, responses: Sequence) -> dict[str, np.ndarray]:
        """`input_ids` (query + response, padded with the tokenizer's pad id on its padding
        side) and `attention_mask`, as TRL's `DataCollatorForLanguageModeling` makes them."""
        seqs = [
            np.concatenate([np.asarray(q), np.asarray(r)])
            for q, r in zip(queries, responses, strict=True)
        ]
        length = max(len(s) for s in seqs)
        if self.config.pad_to_multiple_of:
            length = -(-length // self.config.pad_to_multiple_of) * self.config.pad_to_multiple_of
        ids = np.full((len(seqs), length), self.tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(seqs), length), np.int32)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for i, s in enumerate(seqs):
            sl = slice(length - len(s), length) if left else slice(0, len(s))
            ids[i, sl] = s
            mask[i, sl] = 1
        return {"input_ids": ids, "attention_mask": mask}

    @staticmethod
    def _response_mask(queries, responses, attention_mask_BL, response_masks) -> np.ndarray:
        """TRL's loss mask `[B, L - 1]`: position t is 1 iff token t + 1 is a response token
        (and, with `response_masks`, that token's mask is 1)."""
        B, L = attention_mask_BL.shape
        masks = np.zeros((B, L), np.float32)
        masks[:, :-1] = attention_mask_BL[:, 1:]
        for j in range(B):
            start = len(queries[j]) - 1
            if attention_mask_BL[j, 0] == 0:  # left padding
                start += int(np.argmax(attention_mask_BL[j]))
            end = start + len(responses[j])
            masks[j, :start] = 0
            masks[j, end:] = 0
            if response_masks is not None:
                masks[j, start:end] *= response_masks[j]
        return masks[:, :-1]

    def step(
        self,
        queries: list,
        responses: list,
        scores: list,
        response_masks: list | None = None,
    ) -> dict[str, Any]:
        """One PPO step on a batch of `config.batch_size` (query, response, score) triples;
        returns TRL's stats (see `record_step_stats`, plus `ppo/learning_rate` and `time/ppo/*`)."""
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
        train_stats = self._train_stats(out)
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
        extras = dict(self.train_state.extras)
        extras["kl_ctl"] = self.kl_ctl.update(
            extras["kl_ctl"], stats["objective/kl"], c.batch_size * jax.process_count()
        )
        extras["ppo_step"] = extras["ppo_step"] + 1
        self.train_state = self.train_state.replace(extras=extras)
        timing["time/ppo/total"] = time.time() - t0
        stats.update(timing)
        if c.log_with != "wandb":
            stats = {k: _to_scalar(v) for k, v in stats.items()}
        return stats

    def _current_learning_rate(self) -> float:
        hyper = _learning_rate_hyperparams(self.train_state.opt_state)
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler(self.train_state.extras["ppo_step"]))
        if hyper:
            return float(hyper[0].hyperparams["learning_rate"])
        return float(self.config.learning_rate)

    def _train_stats(self, out: dict) -> dict[str, np.ndarray]:
        """Per-mini-batch stats of the epochs that ran, in TRL's order (epoch, backward batch,
        mini-batch): scalars `[n_minibatches]`, arrays flattened into one row."""
        ran = np.asarray(out["epoch_ran"], bool)
        stats = {k: np.asarray(out["sum"][k])[ran].reshape(-1) for k in ppo.UPDATE_SCALARS}
        skipped = int(stats.pop("ratio_skipped").sum())
        if skipped:
            warnings.warn(
                f"{skipped} mini-batch(es) had an average ratio above ratio_threshold="
                f"{self.config.ratio_threshold:.2f}; their loss was zeroed (batch skipped).",
                UserWarning,
                stacklevel=3,
            )
        adv = np.asarray(out["arrays"]["policy/advantages"])[ran].reshape(1, -1)
        stats["policy/advantages"] = np.nan_to_num(adv, nan=WANDB_PADDING)
        stats["policy/ratio"] = np.asarray(out["arrays"]["policy/ratio"])[ran].reshape(1, -1)
        return stats

    def record_step_stats(self, kl_coef: float, **data: Any) -> dict[str, Any]:
        """TRL's step statistics from the rollout and the per-mini-batch train stats."""
        mask = np.asarray(data.pop("masks"), np.float32)
        logprobs, ref_logprobs = np.asarray(data["logprobs"]), np.asarray(data["ref_logprobs"])
        kl_list = ((logprobs - ref_logprobs) * mask).sum(axis=-1)
        mean_kl = kl_list.mean()
        mean_entropy = (-logprobs * mask).sum(axis=-1).mean()
        non_score = np.asarray(data["non_score_reward"])
        mean_non_score_reward = (non_score * mask).sum() / mask.sum()
        scores = np.asarray(data["scores"], np.float32)
        if mean_kl < -1.0:
            warnings.warn(
                f"KL divergence is starting to become negative: {mean_kl:.2f} - this might be a "
                "precursor for failed training. sometimes this happens because the generation "
                "kwargs are not correctly set. Please make sure that the generation kwargs are "
                "set correctly, or review your training hyperparameters.",
                UserWarning,
                stacklevel=2,
            )
        stats: dict[str, Any] = {
            "objective/kl": float(mean_kl),
            "objective/kl_dist": kl_list,
            "objective/logprobs": logprobs,
            "objective/ref_logprobs": ref_logprobs,
            "objective/kl_coef": float(kl_coef),
            "objective/entropy": float(mean_entropy),
            "ppo/mean_non_score_reward": float(mean_non_score_reward),
            "ppo/mean_scores": float(scores.mean()),
            "ppo/std_scores": float(scores.std(ddof=1)) if scores.size > 1 else float("nan"),
        }
        query_lens = np.array([len(q) for q in data["queries"]], np.float32)
        response_lens = np.array([len(r) for r in data["responses"]], np.float32)
        for name, lens in (("queries", query_lens), ("responses", response_lens)):
            stats[f"tokens/{name}_len_mean"] = float(lens.mean())
            stats[f"tokens/{name}_len_std"] = (
                float(lens.std(ddof=1)) if lens.size > 1 else float("nan")
            )
            stats[f"tokens/{name}_dist"] = lens
        for k, v in data["train_stats"].items():
            mean = np.mean(np.asarray(v), axis=0)
            stats[f"ppo/{k}"] = float(mean) if np.ndim(mean) == 0 else mean
        stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        return stats

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
        queries = [_as_1d_ints(q, "queries") for q in queries]
        responses = [_as_1d_ints(r, "responses") for r in responses]
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
        rewards = np.asarray(
            [
                np.asarray(r.detach().cpu() if hasattr(r, "detach") else r, np.float32)
                for r in rewards
            ]
        ).reshape(-1)
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
        logs["env/reward_mean"] = float(rewards.mean())
        logs["env/reward_std"] = float(rewards.std(ddof=1)) if rewards.size > 1 else float("nan")
        logs["env/reward_dist"] = rewards
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
        """A `GenerationConfig` from transformers `generate` keyword arguments.

        Defaults are transformers' (greedy, top_k=50) with the tokenizer's EOS/pad ids and
        `max_new_tokens=config.response_length`. `min_length` <= 0 (TRL's examples pass -1) and
        `use_cache` are inactive; a positive `min_length`, `max_length`, beams or several return
        sequences raise (use `min_new_tokens` / `max_new_tokens`)."""
        kw = dict(generation_kwargs)
        min_length = kw.pop("min_length", None)
        if min_length is not None and min_length > 0:
            raise ValueError(
                f"min_length={min_length} counts the (left-padded) prompt tokens; pass "
                "min_new_tokens instead."
            )
        kw.pop("use_cache", None)  # the sampler always decodes with its KV cache
        if "max_length" in kw:
            raise ValueError(
                "max_length is not supported; pass max_new_tokens (or length_sampler)."
            )
        for name in ("num_beams", "num_return_sequences"):
            if kw.pop(name, 1) != 1:
                raise ValueError(f"{name} != 1 is not supported by jaxrl's sampler.")
        unknown = sorted(set(kw) - set(GENERATION_KWARGS))
        if unknown:
            raise ValueError(
                f"Unsupported generation kwargs {unknown}; supported: {GENERATION_KWARGS}, "
                "min_length (<= 0), use_cache, num_beams=1, num_return_sequences=1."
            )
        if "top_k" in kw:  # TRL's examples pass top_k=0.0
            if float(kw["top_k"]) != int(kw["top_k"]):
                raise ValueError(f"top_k must be a whole number, got {kw['top_k']}.")
            kw["top_k"] = int(kw["top_k"])
        kw.setdefault("max_new_tokens", self.config.response_length)
        kw.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        kw.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return GenerationConfig(**kw)

    def _sample(
        self, queries: list[np.ndarray], gen: GenerationConfig, key: jax.Array, ref: bool = False
    ) -> list[np.ndarray]:
        """Completions of `queries` from the current policy (or the reference) params, without
        padding: each ends at its first EOS (kept) or after `max_new_tokens`."""
        if ref:
            out = self._ref_sampler(self._ref_params(), queries, gen, seed=key)
        else:
            # With LoRA: base + adapter through the adapter forward (no merged copy).
            params = self._policy_params()["pretrained_model"]
            out = self._sampler(params, queries, gen, seed=key)
        ids_BN, mask_BN = jax.device_get((out.completion_ids_BN, out.completion_mask_BN))
        return [ids_BN[i, : int(mask_BN[i].sum())].astype(np.int64) for i in range(len(queries))]

    def _finish(self, query: np.ndarray, completion: np.ndarray, return_prompt: bool):
        """TRL's `remove_padding`: the response (after the query if `return_prompt`), cut
        after the tokenizer's first EOS anywhere in it."""
        out = np.concatenate([query, completion]) if return_prompt else completion
        eos = np.flatnonzero(out == self.tokenizer.eos_token_id)
        return out[: eos[0] + 1] if eos.size else out

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
            queries = [_as_1d_ints(q, "query_tensor") for q in query_tensor]
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

    # ------------------------------------------------------------------ train() (jaxrl)
    def _build_reward(self, reward: Any) -> Callable | None:
        if reward is None or callable(reward):
            return reward
        if isinstance(reward, str | os.PathLike):
            return self._reward_model_scorer(str(reward))
        raise ValueError(
            "reward must be a callable (prompts, completions) -> scores or the path of a reward "
            f"model, got {type(reward).__name__}."
        )

    def _reward_model_scorer(self, path: str) -> Callable:
        """Score `prompt + completion + eos` texts with a jitted forward of the reward model at
        `path` (its own tokenizer when saved there), right-padded to a multiple of 16."""
        from transformers import AutoTokenizer

        rm = from_pretrained(path, task="sequence_classification")
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tok = self.tokenizer
        graphdef, params = nnx.split(rm)
        forward = jax.jit(lambda p, ids, m: nnx.merge(graphdef, p)(ids, attention_mask=m)[:, 0])
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0

        def score(prompts: list[str], completions: list[str]) -> list[float]:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
            eos = tok.eos_token or ""
            ids = [tok(t if t.endswith(eos) else t + eos)["input_ids"] for t in texts]
            width = -(-max(len(x) for x in ids) // 16) * 16
            ids_BT = np.full((len(ids), width), pad, np.int32)
            mask_BT = np.zeros((len(ids), width), np.int32)
            for i, x in enumerate(ids):
                ids_BT[i, : len(x)], mask_BT[i, : len(x)] = x, 1
            return np.asarray(forward(params, ids_BT, mask_BT), np.float32).tolist()

        return score

    def _check_can_train(self) -> None:
        if self.dataset is None:
            raise ValueError(
                "train() needs a dataset of prompts (a `query` or `prompt` text column, or "
                "`input_ids`)."
            )
        if self.reward is None:
            raise ValueError("train() needs reward= (a callable or a reward model path).")

    def _has_train_data(self) -> bool:
        return self.dataset is not None

    def _ensure_state(self) -> None:
        """The state is built in __init__ (step() works without train())."""

    @property
    def train_batch_size(self) -> int:
        return self.config.batch_size * jax.process_count()

    @property
    def steps_per_epoch(self) -> int:
        steps = len(self.dataset) // self.train_batch_size
        if steps == 0:
            raise ValueError(
                f"The dataset has {len(self.dataset)} prompts, fewer than one batch of "
                f"{self.train_batch_size}."
            )
        return steps

    @property
    def max_steps(self) -> int:
        c = self.config
        return c.max_steps if c.max_steps > 0 else c.total_ppo_epochs

    def _train_iterator(self):
        from jaxrl.data.batching import BatchIterator

        return BatchIterator(
            self.dataset,
            global_batch_size=self.train_batch_size,
            seed=self.config.seed,
            collate_fn=lambda rows: {k: [r[k] for r in rows] for k in rows[0]},
            shuffle=True,
            drop_last=True,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def _batch_queries(self, batch: dict) -> tuple[list[np.ndarray], list[str]]:
        text_col = next((c for c in ("query", "prompt") if c in batch), None)
        if "input_ids" in batch:
            queries = [np.asarray(q, np.int64) for q in batch["input_ids"]]
            texts = (
                batch[text_col]
                if text_col
                else self.tokenizer.batch_decode(queries, skip_special_tokens=True)
            )
            return queries, list(texts)
        if text_col is None:
            raise ValueError(
                f"The dataset needs a `query` or `prompt` column or `input_ids`; got {list(batch)}."
            )
        texts = list(batch[text_col])
        queries = [np.asarray(self.tokenizer(t)["input_ids"], np.int64) for t in texts]
        return queries, texts

    def _train_iteration(self, batch: dict) -> dict:
        """One PPO step: sample responses (key fixed by the step), decode, score, `step()`."""
        c = self.config
        t = time.time()
        queries, prompts = self._batch_queries(batch)
        gen = GenerationConfig(
            max_new_tokens=c.response_length,
            min_new_tokens=c.min_response_length,
            do_sample=True,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        key = jax.random.fold_in(jax.random.key(c.seed + 1), self.state.global_step)
        responses = self._sample(queries, gen, key)
        t_gen, t = time.time() - t, time.time()
        completions = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = [0.0 if s is None else float(s) for s in self.reward(prompts, completions)]
        t_score = time.time() - t
        stats = self.step(queries, responses, [np.float32(s) for s in scores])
        metrics = {
            k: float(np.asarray(v).reshape(()))
            for k, v in stats.items()
            if np.ndim(v) == 0 or np.size(v) == 1
        }
        scores_B = np.asarray(scores, np.float32)
        metrics["env/reward_mean"] = float(scores_B.mean())
        metrics["env/reward_std"] = float(scores_B.std(ddof=1)) if scores_B.size > 1 else 0.0
        metrics["time/ppo/generate"], metrics["time/ppo/score"] = t_gen, t_score
        # The minibatch permutations of later steps come from NumPy's global generator. Placed
        # as the state's copy was (the train state's sharding): a plain `jnp.asarray` (one
        # device, no mesh) changed the optimise step's input type, so every run traced and
        # compiled that step a second time at step 2.
        rng = self.train_state.extras["numpy_rng"]
        self.train_state = self.train_state.replace(
            extras={
                **self.train_state.extras,
                "numpy_rng": jax.device_put(_numpy_rng_state(), rng.sharding),
            }
        )
        return metrics

    def _restore(self, step: int):
        super()._restore(step)
        keys = np.asarray(self.train_state.extras["numpy_rng"]).astype(np.uint32)
        np.random.set_state(("MT19937", keys[:-1], int(keys[-1])))

    def save_model(self, output_dir: str | None = None, merged: bool = False) -> str:
        """Save the policy in TRL's value-head layout (default `output_dir/final`); with LoRA
        the adapter + value head, or with `merged=True` the full model (adapter folded in)."""
        out = output_dir or os.path.join(self.config.output_dir, "final")
        self.save_pretrained(out, merged=merged)
        return out

    def save_pretrained(self, save_directory: str | Path, merged: bool = False) -> None:
        """Policy, tokenizer and model card. Full weights: LM + value head (TRL's layout). With
        LoRA, as TRL's PEFT value-head model: `adapter_config.json` +
        `adapter_model.safetensors` (PEFT's format, `peft.PeftModel.from_pretrained` loads it)
        and `model.safetensors` holding only `v_head.summary.*`; `merged=True`: the full
        value-head model with the adapter folded in (PEFT's `merge_and_unload`)."""
        if merged and not self.is_peft_model:
            raise ValueError("merged=True merges LoRA adapters; this model has none.")
        policy = self.model
        if merged:
            policy.pretrained_model = lora.merge_lora(policy.pretrained_model)
            save_pretrained(policy, save_directory)
        elif self.is_peft_model:
            lora.save_peft_adapter(policy.pretrained_model, save_directory, self.model_path)
            _save_value_head(policy, Path(save_directory))
        else:
            save_pretrained(policy, save_directory)
        if jax.process_index() == 0:
            self.tokenizer.save_pretrained(str(save_directory))
            self.create_model_card(str(save_directory))

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write `README.md` (TRL's card). The model id is `<hub user>/<path>` when the Hub
        user is known, else `path` (TRL skips the card offline; we still write it)."""
        try:
            from huggingface_hub import whoami

            model_id = f"{whoami()['name']}/{path}"
        except Exception:  # offline or not logged in
            model_id = path
        os.makedirs(path, exist_ok=True)
        card = MODEL_CARD_TEMPLATE.format(model_name=model_name, model_id=model_id)
        with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
            f.write(card)


class _AdapterOffSampler(Sampler):
    """A sampler whose traced model skips every LoRA branch: the reference of a LoRA policy
    (the context variable is read when the model is traced, so it wraps the traced functions)."""

    _trace_context = staticmethod(lora.disable_adapter)


def _save_value_head(policy: CausalLMWithValueHead, path: Path) -> None:
    """`model.safetensors` with only TRL's `v_head.summary.*` keys (TRL saves a PEFT value-head
    model's head beside the adapter and reads it back from there)."""
    from jaxrl.models import hf_keys
    from jaxrl.models.weights_io import write_safetensors

    state = nnx.state(policy, nnx.PathContains("v_head"))
    tensors = {}
    for entry in hf_keys.entries(state, policy.config):
        value = jax.device_get(entry.variable.get_value())
        (key,) = entry.keys()
        tensors[key] = hf_keys.ours_to_hf(
            np.asarray(value), entry.path, entry.hf_shape, policy.config
        )
    if jax.process_index() != 0:
        return
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    write_safetensors(path / "model.safetensors", specs, tensors.__getitem__, {"format": "pt"})


def _numpy_rng_state() -> np.ndarray:
    """NumPy's global MT19937 state as one uint32 vector: 624 keys, then the position (no
    Gaussian is ever cached here: only `permutation` draws from it)."""
    _, keys, pos, _, _ = np.random.get_state()
    return np.append(np.asarray(keys, np.uint32), np.uint32(pos))


def _to_scalar(v: Any) -> Any:
    """TRL's `convert_to_scalar`: 0-d or one-element arrays become Python floats."""
    if isinstance(v, np.ndarray | jax.Array) and (v.ndim == 0 or (v.ndim == 1 and v.shape[0] == 1)):
        return float(np.asarray(v).reshape(()))
    return v
