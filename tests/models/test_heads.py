"""Sequence classification (reward model) parity with transformers, heads and round trips."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import (
    SequenceClassificationModel,
    ValueHead,
    from_pretrained,
    save_pretrained,
)
from jaxrl.models.hf_config import config_from_hf
from tests.model_calls import jit_call
from tests.models.conftest import padded_batch

# Jitted (see tests/model_calls.py), a head's per-token scores as its call is.
_token_scores = nnx.jit(lambda model, ids, mask: model.token_scores(ids, mask))


def _torch_scores(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(np.where(mask == 1, ids, 0)).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.numpy()


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("llama", marks=pytest.mark.slow),
        "qwen2",
        "gemma2",
        "gemma3",
        "qwen2_moe",
        "gpt_oss",
    ],
)
def test_scores_match_transformers_and_round_trip(family, hf_seq_cls, tmp_path):
    ref = hf_seq_cls(family)
    model = from_pretrained(ref.path, task="sequence_classification")
    assert isinstance(model, SequenceClassificationModel) and model.num_labels == 1
    ids, right, left = padded_batch(seed=1)
    for mask in (right, left):
        expected = _torch_scores(ref.model, ids, mask)
        got = jit_call(model, jnp.asarray(np.where(mask == 1, ids, 0)), jnp.asarray(mask))
        assert got.shape == (3, 1)
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4)

    # Per-token scores at the last real token are the sequence scores.
    tokens = _token_scores(model, jnp.asarray(ids), jnp.asarray(right))
    assert tokens.shape == (3, ids.shape[1], 1)
    last = right.sum(1) - 1
    np.testing.assert_allclose(
        np.asarray(tokens)[np.arange(3), last],
        np.asarray(jit_call(model, jnp.asarray(ids), jnp.asarray(right))),
        atol=1e-5,
    )

    save_pretrained(model, tmp_path)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == type(ref.model).__name__
    np.testing.assert_allclose(
        _torch_scores(reloaded, ids, left), _torch_scores(ref.model, ids, left), atol=1e-5
    )


def test_score_skips_a_trailing_pad_id_as_transformers(hf_seq_cls):
    """transformers reads a sequence score at the last token whose id is not
    `config.pad_token_id`; when the pad is the EOS (TRL's fallback for tokenizers without a pad)
    the appended EOS is skipped and the score is the previous token's."""
    ref = hf_seq_cls("qwen2")
    model = from_pretrained(ref.path, task="sequence_classification")
    pad = ref.model.config.pad_token_id
    ids, right, _ = padded_batch(seed=3)
    last = right.sum(1) - 1
    ids = np.where(right == 1, ids, pad)
    ids[np.arange(3), last] = pad  # each row ends in the pad id, like an appended EOS = pad
    expected = _torch_scores(ref.model, ids, right)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(right)))
    np.testing.assert_allclose(got, expected, atol=1e-4)
    tokens = np.asarray(model.token_scores(jnp.asarray(ids), jnp.asarray(right)))
    np.testing.assert_allclose(got, tokens[np.arange(3), last - 1], atol=1e-5)
    # An explicit pad id overrides the config's (the reward trainer passes the tokenizer's).
    explicit = model(jnp.asarray(ids), jnp.asarray(right), pad_token_id=pad + 1)
    np.testing.assert_allclose(np.asarray(explicit), tokens[np.arange(3), last], atol=1e-5)


def test_score_head_from_causal_checkpoint_is_fresh(hf_causal):
    ref = hf_causal("gpt2")
    with pytest.warns(UserWarning, match="newly initialised"):
        model = from_pretrained(ref.path, task="sequence_classification", num_labels=2)
    ids, right, _ = padded_batch()
    scores = model(jnp.asarray(ids), jnp.asarray(right))
    assert scores.shape == (3, 2)
    assert float(jnp.abs(model.score.kernel[...]).max()) > 0
    # The backbone is the causal LM's: its hidden states match.
    lm = from_pretrained(ref.path)
    np.testing.assert_allclose(
        np.asarray(model.hidden_states(jnp.asarray(ids), jnp.asarray(right))),
        np.asarray(lm.hidden_states(jnp.asarray(ids), jnp.asarray(right))),
        atol=1e-6,
    )


def test_value_head_gives_per_token_values():
    config = config_from_hf(transformers.LlamaConfig(hidden_size=8, num_attention_heads=2))
    from flax import nnx

    head = ValueHead(config, nnx.Rngs(0))
    h_BTD = jnp.ones((2, 5, 8))
    values = head(h_BTD)
    assert values.shape == (2, 5)
    expected = h_BTD @ head.kernel[...][:, 0] + head.bias[...][0]
    np.testing.assert_allclose(np.asarray(values), np.asarray(expected), atol=1e-6)
