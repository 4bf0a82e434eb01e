"""Heads on top of a decoder backbone: `ScoreHead` (reward models, HF `*ForSequenceClassification`
`score`), `ValueHead` (per-token values for PPO) and `SequenceClassificationModel`.

Scores are read at the last non-pad token (last index where attention_mask == 1), as HF does for
right or left padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.gpt2 import GPT2Model
from jaxrl.models.layers import Dense
from jaxrl.models.llama import LlamaModel


def make_backbone(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The decoder backbone (no LM head) for the config's family."""
    return GPT2Model(config, rngs) if config.model_type == "gpt2" else LlamaModel(config, rngs)


def last_token_index(attention_mask_BT: jax.Array | None, seq_len: int, batch: int) -> jax.Array:
    """[B] index of the last position with attention_mask == 1 (T - 1 without a mask)."""
    if attention_mask_BT is None:
        return jnp.full((batch,), seq_len - 1, dtype=jnp.int32)
    if attention_mask_BT.ndim != 2:
        raise ValueError(
            "Sequence scores are read at the last real token of a [B, T] padding mask; an "
            f"explicit attention mask of shape {attention_mask_BT.shape} does not say which it is."
        )
    idx_BT = jnp.arange(seq_len, dtype=jnp.int32)[None, :] * (attention_mask_BT != 0)
    return jnp.max(idx_BT, axis=1)


class ScoreHead(Dense):
    """Linear D -> num_labels without bias (HF `score.weight`), applied per token."""

    def __init__(self, config: ModelConfig, num_labels: int, rngs: nnx.Rngs):
        super().__init__(
            (config.hidden_size,), (num_labels,), ("embed",), ("labels",), config, rngs
        )


class ValueHead(Dense):
    """Per-token scalar value (PPO critic): Linear D -> 1 with bias, `(h_BTD) -> values_BT`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        super().__init__(
            (config.hidden_size,), (1,), ("embed",), ("labels",), config, rngs, use_bias=True
        )

    def __call__(self, h_BTD: jax.Array) -> jax.Array:
        return super().__call__(h_BTD)[..., 0]


class SequenceClassificationModel(nnx.Module):
    """Backbone + `ScoreHead` (HF `XForSequenceClassification`), any supported family.

    `model(input_ids, attention_mask) -> scores_BN` at the last non-pad token;
    `token_scores(...) -> scores_BTN` at every position.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, *, num_labels: int = 1):
        self.config = config
        self.num_labels = num_labels
        self.backbone = make_backbone(config, rngs)
        self.score = ScoreHead(config, num_labels, rngs)

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final-norm hidden states [B, T, D] (the input of the score head)."""
        return self.backbone(input_ids_BT, attention_mask, positions, segment_ids)

    def token_scores(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Scores at every position [B, T, num_labels]."""
        return self.score(self.hidden_states(input_ids_BT, attention_mask, positions, segment_ids))

    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        batch, seq_len = input_ids_BT.shape
        h_BTD = self.hidden_states(input_ids_BT, attention_mask, positions, segment_ids)
        last_B = last_token_index(attention_mask, seq_len, batch)
        h_BD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]
        return self.score(h_BD)
