"""The causal-LM wrapper every family shares: a backbone under HF's attribute name plus an LM head
(absent when tied to the input embedding), as HF's `XForCausalLM` classes are."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.dropout import model_dropout
from jaxrl.models.kv_cache import Cache, CacheView
from jaxrl.models.layers import Dense, param_value


class CausalLM(nnx.Module):
    """`model(input_ids, attention_mask) -> logits_BTV`.

    A family subclasses it with `backbone_cls` (its `XModel`, whose `__call__` gives final-norm
    hidden states and `cached` the KV-cache path) and `base_model_prefix` (HF's attribute name for
    it: "model", "transformer"), so parameter paths follow the HF module tree one to one.
    """

    base_model_prefix: ClassVar[str]
    backbone_cls: ClassVar[type[nnx.Module]]

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        setattr(self, self.base_model_prefix, self.backbone_cls(config, rngs))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(
                (config.hidden_size,), (config.vocab_size,), ("embed",), ("vocab",), config, rngs
            )
        )

    @property
    def backbone(self) -> nnx.Module:
        return getattr(self, self.base_model_prefix)

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        pixel_values: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final-norm hidden states [B, T, D] (the input of the LM head). `pixel_values` and
        `token_type_ids` are for image-text models (`jaxrl.models.vision`)."""
        if pixel_values is not None or token_type_ids is not None:
            hint = (
                " Load the image-text checkpoint with vision=True to run its vision tower."
                if self.config.language_model_prefix
                else ""
            )
            raise ValueError(
                f"This {self.config.model_type} model takes text only (no pixel_values or "
                f"token_type_ids).{hint}"
            )
        return self.backbone(input_ids_BT, attention_mask, positions, segment_ids)

    def cached_hidden_states(
        self, input_ids_BT: jax.Array, positions_BT: jax.Array, cache: Cache, view: CacheView
    ) -> tuple[jax.Array, Cache]:
        """`hidden_states` of new tokens with a KV cache (what `jaxrl.generation` calls).
        Generation never drops, even inside a training forward's `model_dropout`."""
        with model_dropout(None):
            return self.backbone.cached(input_ids_BT, positions_BT, cache, view)

    def unembed_weight(self) -> jax.Array:
        """W [D, V] in the compute dtype with logits == hidden_states @ W (Granite's division by
        `logits_scaling` folded in, so every head that forms logits from it divides too)."""
        if self.lm_head is None:
            w = self.backbone.input_embedding().T
        else:
            w = param_value(self.lm_head.kernel)
        if self.config.logits_scaling != 1.0:
            w = w / jnp.asarray(self.config.logits_scaling, w.dtype)
        return w.astype(self.config.dtype)

    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        pixel_values: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
    ) -> jax.Array:
        h_BTD = self.hidden_states(
            input_ids_BT, attention_mask, positions, segment_ids, pixel_values, token_type_ids
        )
        # The LM head is a compute-dtype matmul (bf16 logits under autocast).
        logits_BTV = jnp.dot(h_BTD.astype(self.config.dtype), self.unembed_weight())
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits_BTV
        # Gemma 2's final_logit_softcapping, in the logits' dtype as transformers computes it.
        return (jnp.tanh(logits_BTV / cap) * cap).astype(logits_BTV.dtype)
