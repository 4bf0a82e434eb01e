"""Logit parity with PyTorch transformers for every family, load and save round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxrl.models import from_pretrained, save_pretrained
from tests.model_calls import jit_call
from tests.models.conftest import FAMILIES, padded_batch, torch_logits


def _masked_max_diff(a, b, mask):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) * mask[..., None]))


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            f, marks=pytest.mark.slow if f in ("llama3_rope", "mistral", "qwen3", "gemma") else ()
        )
        for f in FAMILIES
    ],
)
def test_logits_match_transformers_and_round_trip(family, hf_causal, tmp_path):
    ref = hf_causal(family)
    model = from_pretrained(ref.path)
    ids, right, left = padded_batch()
    for mask in (right, left):
        expected = torch_logits(ref.model, ids, mask)
        got = jit_call(model, jnp.asarray(np.where(mask == 1, ids, 0)), jnp.asarray(mask))
        assert got.shape == expected.shape
        assert _masked_max_diff(got, expected, mask) <= 1e-4, family

    save_pretrained(model, tmp_path, max_shard_size="30KB" if family == "qwen3" else "5GB")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == type(ref.model).__name__
    expected = torch_logits(ref.model, ids, left)
    assert _masked_max_diff(torch_logits(reloaded, ids, left), expected, left) <= 1e-5


def test_sharded_save_writes_index(hf_causal, tmp_path):
    model = from_pretrained(hf_causal("llama").path)
    save_pretrained(model, tmp_path, max_shard_size=30_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "gemma3"])
def test_pad_embedding_row_gets_no_gradient_as_in_transformers(family, hf_causal):
    """HF builds the token embedding with `padding_idx=config.pad_token_id`: a pad id used as
    an input (here in the middle of real tokens) passes no gradient to its row; the other rows'
    gradients equal torch autograd's (for Gemma 2 through both soft-caps' backward)."""
    import torch

    ref = hf_causal(family)
    ids, right, _ = padded_batch()
    ids[:, 2] = 0  # the config's pad_token_id, as a real (attended) token
    ref.model.zero_grad()
    out = ref.model(input_ids=torch.from_numpy(ids).long())
    (out.logits.float() ** 2).mean().backward()
    want = ref.model.model.embed_tokens.weight.grad.numpy()

    graphdef, params = nnx.split(from_pretrained(ref.path))

    def loss(params):
        return jnp.mean(nnx.merge(graphdef, params)(jnp.asarray(ids)).astype(jnp.float32) ** 2)

    got = np.asarray(jax.jit(jax.grad(loss))(params)["model"]["embed_tokens"]["embedding"][...])
    assert np.abs(want[0]).max() == 0 and np.abs(got[0]).max() == 0
    assert np.abs(want).max() > 1e-4
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_longrope_switches_at_the_original_context(hf_causal):
    """Phi-3's LongRoPE: rows up to the original context (8 positions) rotate with the short
    factors, a batch whose longest row is past it with the long ones, as transformers picks by
    the largest position id."""
    ref = hf_causal("phi3")
    model = from_pretrained(ref.path)
    for seq_len in (6, 8, 9):
        ids, right, _ = padded_batch(seed=seq_len, seq_len=seq_len)
        expected = torch_logits(ref.model, ids, right)
        got = jit_call(model, jnp.asarray(np.where(right == 1, ids, 0)), jnp.asarray(right))
        assert _masked_max_diff(got, expected, right) <= 1e-4, seq_len


@pytest.mark.parametrize("family", ["phi3", "gemma2", "granite", "gpt_oss"])
def test_every_gradient_equals_torch(family, hf_causal, tmp_path):
    """Gradients of mean(logits ** 2) w.r.t. every weight equal torch autograd's, compared in
    HF's layout (the gradient tree saved as a checkpoint): Phi-3's fused qkv_proj/gate_up_proj
    and partial LongRoPE, Gemma 2's soft-capped scores and logits, Granite's multipliers and
    logits scaling (folded into the tied unembedding), GPT-OSS's attention sinks, router and
    expert biases and clamped SwiGLU (gate/up re-interleaved in the saved gradients)."""
    import torch
    from safetensors.numpy import load_file

    ref = hf_causal(family)
    ids, right, _ = padded_batch()
    ref.model.zero_grad()
    out = ref.model(input_ids=torch.from_numpy(ids).long())
    (out.logits.float() ** 2).mean().backward()
    want = {name: p.grad.numpy() for name, p in ref.model.named_parameters()}

    model = from_pretrained(ref.path)
    graphdef, params = nnx.split(model)

    def loss(params):
        return jnp.mean(nnx.merge(graphdef, params)(jnp.asarray(ids)).astype(jnp.float32) ** 2)

    nnx.update(model, jax.jit(jax.grad(loss))(params))
    save_pretrained(model, tmp_path)
    got = load_file(tmp_path / "model.safetensors")
    assert set(got) == set(want)
    for name, grad in want.items():
        scale = max(np.abs(grad).max(), 1e-6)
        np.testing.assert_allclose(got[name] / scale, grad / scale, atol=2e-5, err_msg=name)
