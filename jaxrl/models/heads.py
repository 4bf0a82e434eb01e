"""Heads on top of a decoder backbone: `ScoreHead` (reward models, HF `*ForSequenceClassification`
`score`), `ValueHead` (per-token values for PPO), `SequenceClassificationModel`, and
`CausalLMWithValueHead` (TRL's `AutoModelForCausalLMWithValueHead`: an LM plus a value head whose
params are saved as `v_head.summary.{weight,bias}` beside the LM's own keys).

Scores are read at the last non-pad token (last index where attention_mask == 1), as HF does for
right or left padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.core.logprobs import token_logprobs, unembed_logits
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.models.gpt2 import GPT2ForCausalLM, GPT2Model
from jaxrl.models.gpt_oss import GptOssForCausalLM, GptOssModel
from jaxrl.models.layers import Dense, param_value
from jaxrl.models.llama import LlamaForCausalLM, LlamaModel

V_HEAD_INIT_STRATEGIES = (None, "normal")
# `Family.decoder` -> its backbone and causal-LM classes.
BACKBONES = {"llama": LlamaModel, "gpt2": GPT2Model, "gpt_oss": GptOssModel}
CAUSAL_LMS = {"llama": LlamaForCausalLM, "gpt2": GPT2ForCausalLM, "gpt_oss": GptOssForCausalLM}


def make_backbone(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The decoder backbone (no LM head) for the config's family."""
    return BACKBONES[family(config.model_type).decoder](config, rngs)


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


def score_mask(
    input_ids_BT: jax.Array, attention_mask_BT: jax.Array | None, pad_token_id: int | None
) -> jax.Array | None:
    """The positions a sequence score may be read at: real tokens whose id is not the pad id.

    transformers' `XForSequenceClassification` reads the last token whose id is not
    `config.pad_token_id`, and TRL's `RewardTrainer` (and GRPO's reward models) set that to the
    tokenizer's pad token, which is the EOS when the tokenizer has none. A trailing EOS is then
    not scored: the score is read at the token before it, in training as after export.
    """
    if pad_token_id is None:
        return attention_mask_BT
    not_pad_BT = input_ids_BT != pad_token_id
    if attention_mask_BT is None:
        return not_pad_BT
    return (attention_mask_BT != 0) & not_pad_BT


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
        *,
        pad_token_id: int | None = None,
    ) -> jax.Array:
        """Scores `[B, num_labels]` at each row's last real token whose id is not the pad id
        (`score_mask`; `pad_token_id` defaults to the HF config's, as transformers reads it)."""
        h_BTD = self.hidden_states(input_ids_BT, attention_mask, positions, segment_ids)
        if pad_token_id is None:
            hf_config = self.config.hf_config
            text = hf_config.get_text_config() if hf_config is not None else None
            pad_token_id = getattr(text, "pad_token_id", None)
        return self.last_token_scores(h_BTD, score_mask(input_ids_BT, attention_mask, pad_token_id))

    def last_token_scores(self, h_BTD: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
        """Scores [B, num_labels] of hidden states `h_BTD` at each row's last non-pad token."""
        batch, seq_len = h_BTD.shape[:2]
        last_B = last_token_index(attention_mask, seq_len, batch)
        h_BD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]
        return self.score(h_BD)


def value_head_init(
    key: jax.Array,
    hidden_size: int,
    dtype: jax.typing.DTypeLike,
    init_strategy: str | None = None,
    initializer_range: float = 0.2,
) -> tuple[jax.Array, jax.Array]:
    """`(kernel [D, 1], bias [1])` of a fresh value head, as TRL initialises `v_head.summary`.

    `None`: torch `nn.Linear`'s default, uniform(+-1/sqrt(D)) for weight and bias (kaiming
    uniform with a=sqrt(5)); `"normal"`: weight ~ N(0, initializer_range), bias 0.
    """
    if init_strategy not in V_HEAD_INIT_STRATEGIES:
        raise ValueError(
            f"v_head_init_strategy={init_strategy!r} is not supported; use one of "
            f"{V_HEAD_INIT_STRATEGIES}."
        )
    k_w, k_b = jax.random.split(key)
    if init_strategy == "normal":
        kernel = initializer_range * jax.random.normal(k_w, (hidden_size, 1), dtype)
        return kernel, jnp.zeros((1,), dtype)
    bound = 1.0 / hidden_size**0.5
    kernel = jax.random.uniform(k_w, (hidden_size, 1), dtype, -bound, bound)
    return kernel, jax.random.uniform(k_b, (1,), dtype, -bound, bound)


class SummaryValueHead(nnx.Module):
    """TRL's `ValueHead`: dropout, then `summary` (Linear D -> 1 with bias) in the weight dtype.

    Dropout applies only when a `dropout_rng` is passed; TRL's PPO `step()` runs every forward in
    eval mode, so inside PPO training it never fires (we pass none there).
    """

    def __init__(
        self,
        config: ModelConfig,
        rngs: nnx.Rngs,
        *,
        summary_dropout_prob: float | None = 0.1,
        init_strategy: str | None = None,
        initializer_range: float = 0.2,
    ):
        self.summary = ValueHead(config, rngs)
        kernel, bias = value_head_init(
            rngs.params(), config.hidden_size, config.param_dtype, init_strategy, initializer_range
        )
        self.summary.kernel.set_value(kernel)
        self.summary.bias.set_value(bias)
        self.dropout_prob = float(summary_dropout_prob or 0.0)

    def __call__(self, h_BTD: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        kernel_D1 = param_value(self.summary.kernel)
        if dropout_rng is not None and self.dropout_prob > 0:
            keep = 1.0 - self.dropout_prob
            keep_BTD = jax.random.bernoulli(dropout_rng, keep, h_BTD.shape)
            h_BTD = jnp.where(keep_BTD, h_BTD / keep, 0).astype(h_BTD.dtype)
        h_BTD = h_BTD.astype(kernel_D1.dtype)  # TRL casts to the head's weight dtype (fp32 upcast)
        return (h_BTD @ kernel_D1)[..., 0] + param_value(self.summary.bias)[0]


class CausalLMWithValueHead(nnx.Module):
    """An LM (`pretrained_model`) and a value head (`v_head`) reading the LM's final hidden
    states (TRL's `hidden_states[-1]`): `model(input_ids, attention_mask) -> (logits_BTV f32,
    values_BT)`. `token_logprobs_and_values` gives target log-probs without full logits."""

    def __init__(
        self,
        config: ModelConfig,
        rngs: nnx.Rngs,
        *,
        summary_dropout_prob: float | None = None,
        v_head_init_strategy: str | None = None,
        v_head_initializer_range: float = 0.2,
    ):
        self.config = config
        lm_cls = CAUSAL_LMS[family(config.model_type).decoder]
        self.pretrained_model = lm_cls(config, rngs)
        self.v_head = SummaryValueHead(
            config,
            rngs,
            summary_dropout_prob=resolve_summary_dropout(config, summary_dropout_prob),
            init_strategy=v_head_init_strategy,
            initializer_range=v_head_initializer_range,
        )

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        return self.pretrained_model.hidden_states(input_ids_BT, attention_mask, positions)

    def unembed_weight(self) -> jax.Array:
        return self.pretrained_model.unembed_weight()

    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        dropout_rng: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        h_BTD = self.hidden_states(input_ids_BT, attention_mask, positions)
        logits_BTV = unembed_logits(h_BTD, self.unembed_weight(), self.config.final_logit_softcap)
        return logits_BTV, self.v_head(h_BTD, dropout_rng)

    def token_logprobs_and_values(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        chunk_size: int | None = None,
        with_entropy: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """TRL's `batched_forward_pass` outputs for one batch, aligned to length T - 1:
        `logprobs[t] = log p(input_ids[t + 1] | <= t)`, `values[t]` = V(state at t), and (with
        `with_entropy`) the next-token entropy at t. Logits are formed chunk by chunk."""
        h_BTD = self.hidden_states(input_ids_BT, attention_mask, positions)
        out = token_logprobs(
            h_BTD[:, :-1],
            self.unembed_weight(),
            input_ids_BT[:, 1:],
            chunk_size=chunk_size,
            with_stats=with_entropy,
            logit_softcap=self.config.final_logit_softcap,
        )
        logps_BT, stats = out if with_entropy else (out, {})
        return logps_BT, self.v_head(h_BTD[:, :-1]), stats.get("entropy")


def resolve_summary_dropout(config: ModelConfig, summary_dropout_prob: float | None) -> float:
    """TRL's rule: the HF config's `summary_dropout_prob` if it has one, else the argument,
    else 0.1."""
    hf_value = getattr(config.hf_config, "summary_dropout_prob", None)
    if hf_value is not None:
        return hf_value
    return 0.1 if summary_dropout_prob is None else summary_dropout_prob
