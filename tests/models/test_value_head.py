"""CausalLMWithValueHead: TRL AutoModelForCausalLMWithValueHead layout (`v_head.summary.*` beside
the LM keys) in both directions, values equal to `hidden_states[-1] @ W + b` in torch, TRL's
init strategies and the dropout semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jaxrl import AutoModelForCausalLMWithValueHead
from jaxrl.models import CausalLMWithValueHead, save_pretrained
from tests.models.conftest import padded_batch


def _write_trl_checkpoint(ref, tmp_path, seed: int):
    """What TRL's `save_pretrained` writes: the LM state dict plus `v_head.summary.*`."""
    torch.manual_seed(seed)
    hidden = ref.model.config.hidden_size
    summary = torch.nn.Linear(hidden, 1)
    state = {k: v.contiguous() for k, v in ref.model.state_dict().items()}
    if ref.model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state["v_head.summary.weight"] = summary.weight.detach().clone()
    state["v_head.summary.bias"] = summary.bias.detach().clone()
    ref.model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return summary


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loads_trl_layout_and_saves_it_back(hf_causal, tmp_path, family):
    ref = hf_causal(family)
    summary = _write_trl_checkpoint(ref, tmp_path / "trl", seed=3)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "trl")
    assert isinstance(model, CausalLMWithValueHead)
    ids, right, _ = padded_batch()
    with torch.no_grad():
        out = ref.model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(right).long(),
            output_hidden_states=True,
        )
        want_values = summary(out.hidden_states[-1]).squeeze(-1).numpy()
    logits, values = model(jnp.asarray(ids), jnp.asarray(right))
    keep = right.astype(bool)
    np.testing.assert_allclose(np.asarray(values)[keep], want_values[keep], atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits)[keep], out.logits.numpy()[keep], atol=2e-4)
    assert logits.dtype == jnp.float32

    # Chunked log-probs / values / entropy agree with the full logits, shifted by one.
    logps, v_shift, entropy = model.token_logprobs_and_values(
        jnp.asarray(ids), jnp.asarray(right), chunk_size=4, with_entropy=True
    )
    full = jax.nn.log_softmax(logits[:, :-1], -1)
    np.testing.assert_allclose(
        logps, jnp.take_along_axis(full, jnp.asarray(ids)[:, 1:, None], -1)[..., 0], atol=1e-5
    )
    np.testing.assert_allclose(v_shift, values[:, :-1], atol=1e-6)
    np.testing.assert_allclose(entropy, -jnp.sum(jnp.exp(full) * full, -1), atol=1e-5)

    save_pretrained(model, tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        np.testing.assert_allclose(
            f.get_tensor("v_head.summary.weight"), summary.weight.detach().numpy()
        )
        np.testing.assert_allclose(
            f.get_tensor("v_head.summary.bias"), summary.bias.detach().numpy()
        )
    with safe_open(str(tmp_path / "trl" / "model.safetensors"), "np") as f:
        assert keys == set(f.keys())
    again = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(again(jnp.asarray(ids), jnp.asarray(right))[1], values)


def test_fresh_value_head_init_strategies(hf_causal):
    ref = hf_causal("gpt2")  # a plain LM checkpoint: no v_head keys
    d = ref.model.config.hidden_size
    default = AutoModelForCausalLMWithValueHead.from_pretrained(ref.path, seed=1)
    w = np.asarray(default.v_head.summary.kernel[...])
    b = np.asarray(default.v_head.summary.bias[...])
    bound = 1 / np.sqrt(d)  # torch nn.Linear default init
    assert w.shape == (d, 1) and np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert w.std() > bound / 4
    normal = AutoModelForCausalLMWithValueHead.from_pretrained(
        ref.path, v_head_init_strategy="normal", v_head_initializer_range=0.5
    )
    w = np.asarray(normal.v_head.summary.kernel[...])
    assert 0.3 < w.std() < 0.7 and float(normal.v_head.summary.bias[...][0]) == 0.0
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(ref.path, v_head_init_strategy="xavier")


@pytest.mark.slow
def test_summary_dropout_semantics(hf_causal):
    ref = hf_causal("llama")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(ref.path)
    assert model.v_head.dropout_prob == pytest.approx(0.1)  # TRL default
    off = AutoModelForCausalLMWithValueHead.from_pretrained(ref.path, summary_dropout_prob=0.0)
    assert off.v_head.dropout_prob == 0.0
    ids, right, _ = padded_batch()
    ids, right = jnp.asarray(ids), jnp.asarray(right)
    _, v_eval = model(ids, right)
    _, v_again = model(ids, right)
    np.testing.assert_array_equal(v_eval, v_again)  # no rng: deterministic (PPO step semantics)
    _, v_drop = model(ids, right, dropout_rng=jax.random.key(0))
    assert not np.allclose(v_drop, v_eval)
    _, v_off = off(ids, right, dropout_rng=jax.random.key(0))
    np.testing.assert_allclose(v_off, off(ids, right)[1])
