"""How `PPOTrainer` gets its models and optimizer, with TRL v0.7.2's semantics: the value-head
policy (a path / Hub id, a transformers causal LM or a built `CausalLMWithValueHead`), the
frozen reference (a path, a causal LM (ours or transformers'), a value-head model's LM, or the
policy's own LM), and the optax chain (gradient clipping, a user optimizer or Adam with an injectable rate, and `num_shared_layers`' frozen
embeddings and first layers as a 0/1 update mask).

LoRA / QLoRA on the policy's LM is `jaxrl.trainers.model_setup.setup_peft`, shared with every
trainer. No data, no training step, no export here.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl.core import optim
from jaxrl.lora.value_head import AutoModelForCausalLMWithValueHead
from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.heads import CausalLMWithValueHead
from jaxrl.models.hf import from_pretrained
from jaxrl.models.hf_objects import from_transformers, is_transformers_model


def load_policy(model: Any, seed: int) -> CausalLMWithValueHead:
    if isinstance(model, str | os.PathLike):
        return AutoModelForCausalLMWithValueHead.from_pretrained(model, seed=seed)
    if isinstance(model, CausalLMWithValueHead):
        return model
    if is_transformers_model(model):  # its LM weights, read in memory; a new value head
        return from_transformers(
            model, task="causal_lm_with_value_head", value_head_kwargs={"seed": seed}
        )
    raise ValueError(
        "model must be a jaxrl CausalLMWithValueHead, a transformers causal LM or a path / Hub "
        f"id of one (value head keys optional), got {type(model).__name__}. Load one with "
        "jaxrl.AutoModelForCausalLMWithValueHead.from_pretrained(...)."
    )


def reference(policy: CausalLMWithValueHead, ref_model: Any, num_shared_layers):
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
    if is_transformers_model(ref_model):
        return from_transformers(ref_model)
    raise ValueError(
        "ref_model must be None, a path, a transformers causal LM, or a jaxrl causal LM / "
        "CausalLMWithValueHead, got "
        f"{type(ref_model).__name__}."
    )


def make_tx(
    config: Any, optimizer, params, num_shared_layers, model_config
) -> optax.GradientTransformation:
    c = config
    inner = (
        optimizer
        if optimizer is not None
        else optax.inject_hyperparams(optax.adam)(learning_rate=c.learning_rate)
    )
    parts = []
    mask = trainable_mask(params, num_shared_layers, model_config)
    if mask is not None:
        parts.append(optim.masked_updates(mask))
    if c.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(c.max_grad_norm))
    parts.append(inner)
    if mask is not None:  # also after: a user optimizer may decay weights
        parts.append(optim.masked_updates(mask))
    return optax.chain(*parts)


def trainable_mask(params: Any, num_shared_layers: int | None, model_config: Any) -> Any:
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
