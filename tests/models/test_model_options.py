"""Model options: scanned layers, remat, mixed precision, packing with segment ids, padding,
the unembedding used by chunked log-probs, presets and FLOP counts."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxrl.models import (
    config_from_hf,
    count_params,
    flops_per_token,
    from_config,
    from_pretrained,
    get_preset,
    save_pretrained,
)
from tests.model_calls import jit_call
from tests.models.conftest import padded_batch


@pytest.fixture(scope="module")
def mistral_dir(hf_causal):
    return hf_causal("mistral").path  # sliding window 3 < sequence length


def _logits_and_grads(model, ids, mask):
    graphdef, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, params)(ids, mask)
        return jnp.sum(jnp.square(logits) * mask[..., None]), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    flat = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    q_grads = flat.get(("model", "layers", "self_attn", "q_proj", "kernel"))
    if q_grads is None:  # unscanned: one entry per layer
        q_grads = np.stack(
            [flat[("model", "layers", i, "self_attn", "q_proj", "kernel")] for i in range(2)]
        )
    return np.asarray(logits), q_grads, flat[("model", "embed_tokens", "embedding")]


@pytest.mark.slow
def test_scan_and_remat_give_same_logits_and_grads(mistral_dir):
    ids, right, _ = padded_batch()
    ids, mask = jnp.asarray(ids), jnp.asarray(right)
    want = _logits_and_grads(from_pretrained(mistral_dir), ids, mask)
    assert np.abs(want[1]).max() > 0
    for scan, policy in [
        (True, "none"),
        (False, "full"),
        (True, "dots_with_no_batch_dims_saveable"),
    ]:
        model = from_pretrained(mistral_dir, scan_layers=scan, remat_policy=policy)
        chex.assert_trees_all_close(_logits_and_grads(model, ids, mask), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_mixed_sliding_and_full_layers_scan_like_unscanned(hf_causal, tmp_path):
    config = transformers.AutoConfig.from_pretrained(hf_causal("qwen2").path)
    config.layer_types = ["full_attention", "sliding_attention"]
    config.use_sliding_window, config.sliding_window = True, 2
    ids, right, _ = padded_batch()
    unscanned = from_config(config, seed=3)
    assert unscanned.config.sliding_layers == (False, True)
    save_pretrained(unscanned, tmp_path / "mixed")
    scanned = from_pretrained(tmp_path / "mixed", scan_layers=True)  # the flag is scanned per layer
    want = np.asarray(jit_call(unscanned, jnp.asarray(ids), jnp.asarray(right)))
    np.testing.assert_allclose(
        np.asarray(jit_call(scanned, jnp.asarray(ids), jnp.asarray(right))), want, atol=1e-5
    )
    # Both layer kinds matter: all-full attention (the same weights, loaded with an edited
    # config.json: a second from_config compiled a second init program) differs.
    shutil.copytree(tmp_path / "mixed", tmp_path / "full")
    saved = json.loads((tmp_path / "full" / "config.json").read_text())
    saved["layer_types"] = ["full_attention", "full_attention"]
    (tmp_path / "full" / "config.json").write_text(json.dumps(saved))
    full = from_pretrained(tmp_path / "full")
    assert full.config.sliding_layers == (False, False)
    assert (
        np.abs(np.asarray(jit_call(full, jnp.asarray(ids), jnp.asarray(right))) - want).max() > 1e-3
    )


def test_sliding_window_changes_attention(mistral_dir, tmp_path):
    shutil.copytree(mistral_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids, right, _ = padded_batch()
    ids, right = jnp.asarray(ids), jnp.asarray(right)
    windowed = np.asarray(jit_call(from_pretrained(mistral_dir), ids, right))
    full = np.asarray(jit_call(from_pretrained(tmp_path), ids, right))
    np.testing.assert_allclose(windowed[:, :3], full[:, :3], atol=1e-5)  # inside the window
    assert np.abs(windowed[0, 5:] - full[0, 5:]).max() > 1e-3


@pytest.mark.slow
def test_bf16_compute_with_f32_params_is_close(hf_causal):
    path = hf_causal("qwen3").path
    ids, right, _ = padded_batch()
    f32 = from_pretrained(path)
    bf16 = from_pretrained(path, dtype=jnp.bfloat16)
    assert bf16.model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.float32
    got = jit_call(bf16, jnp.asarray(ids), jnp.asarray(right))
    assert got.dtype == jnp.bfloat16
    want = np.asarray(jit_call(f32, jnp.asarray(ids), jnp.asarray(right)))
    err = np.abs(np.asarray(got, np.float32) - want) * right[..., None]
    assert err.max() < 0.05 * np.abs(want).max()
    stored = from_pretrained(path, param_dtype=jnp.bfloat16)
    assert stored.model.norm.scale[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_packed_segments_match_separate_sequences(family, hf_causal):
    model = from_pretrained(hf_causal(family).path)
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(3, 128, 5), rng.integers(3, 128, 3)
    ids = np.zeros((3, 10), np.int32)
    ids[0, :8] = np.concatenate([doc_a, doc_b])  # packed row, 2 pad tokens at the end
    ids[1, :5], ids[2, :3] = doc_a, doc_b  # each document alone, right padded
    segment_ids = np.zeros((3, 10), np.int32)
    segment_ids[0, :5], segment_ids[0, 5:8], segment_ids[1, :5], segment_ids[2, :3] = 1, 2, 1, 1

    @nnx.jit  # both forwards in one program
    def forwards(model, ids, segment_ids):
        # Default positions restart at every segment (GPT-2's learned positions depend on it).
        return model(ids, segment_ids=segment_ids), model(ids[:1])

    got, unpacked = (np.asarray(x) for x in forwards(model, ids, segment_ids))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[0, :5], got[1, :5], atol=1e-5)
    np.testing.assert_allclose(got[0, 5:8], got[2, :3], atol=1e-5)
    # Without segment ids the second document attends to the first and differs.
    assert np.abs(unpacked[0, 5:8] - got[2, :3]).max() > 1e-3


def test_padding_rows_finite_and_unembed_matches_logits(hf_causal):
    model = from_pretrained(hf_causal("qwen2").path)
    ids, _, left = padded_batch()
    ids, mask = jnp.asarray(ids), jnp.asarray(left)

    @nnx.jit
    def run(model):
        w_DV = model.unembed_weight()
        return model(ids, mask), w_DV, model.hidden_states(ids, mask) @ w_DV

    logits, w_DV, unembedded = run(model)
    assert np.isfinite(np.asarray(logits)).all()
    assert w_DV.shape == (64, 128)
    np.testing.assert_allclose(np.asarray(unembedded), np.asarray(logits), atol=1e-5)


def test_presets_and_flops():
    config = get_preset("qwen2.5-0.5b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        896,
        24,
        2,
    )
    model = nnx.eval_shape(lambda: from_config(get_preset("llama-tiny")))
    # embed + untied head 2*256*64; per layer q,o 64*64, k,v 64*32, mlp 3*64*128, 2 norms; final norm
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert count_params(model) == 2 * 256 * 64 + 2 * layer + 64
    n_matmul = 2 * (layer - 2 * 64) + 64 * 256
    assert flops_per_token(get_preset("llama-tiny"), 100) == 6 * n_matmul + 12 * 2 * 4 * 16 * 100
    with pytest.raises(ValueError, match="Unknown model preset"):
        get_preset("nope")


def test_gemma3_preset_has_the_checkpoint_parameter_count():
    import torch

    config = get_preset("gemma-3-1b")
    with torch.device("meta"):
        theirs = sum(
            p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
        )
    assert count_params(nnx.eval_shape(lambda: from_config(config))) == theirs == 999_885_952
    ours = config_from_hf(config)
    assert (
        ours.sliding_layers.count(False) == 4 and not ours.sliding_layers[5]
    )  # 5 local : 1 global


def test_from_config_init_like_hf():
    model = from_config(get_preset("gpt2-tiny"), seed=0)
    block = model.transformer.h[0]
    # GPT-2 residual projections: 0.02 / sqrt(2 * n_layer) = 0.01; others 0.02; biases 0.
    # (On the host: eager jnp statistics would compile a program per op.)
    assert 0.009 < float(np.std(np.asarray(block.mlp.c_proj.kernel[...]))) < 0.011
    assert 0.018 < float(np.std(np.asarray(block.mlp.c_fc.kernel[...]))) < 0.022
    assert float(np.abs(np.asarray(block.mlp.c_fc.bias[...])).max()) == 0.0
    assert float(np.abs(np.asarray(block.ln_1.scale[...]) - 1).max()) == 0.0
    other = from_config(get_preset("gpt2-tiny"), seed=1)
    embeddings = (np.asarray(m.transformer.wte.embedding[...]) for m in (other, model))
    assert float(np.abs(np.subtract(*embeddings)).max()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_prefix_tree_mask_matches_separate_sequences(family, hf_causal):
    """DPO prefix sharing: one row prompt + chosen + rejected under an explicit [B, T, S] mask
    gives each branch the logits of its own prompt + completion row."""
    from jaxrl.algos.masks import prefix_tree_mask
    from jaxrl.data.collate import collate_preference_shared

    model = from_pretrained(hf_causal(family).path)
    rng = np.random.default_rng(1)
    p, c, r = (rng.integers(3, 128, n).tolist() for n in (4, 3, 5))
    shared = collate_preference_shared(
        [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}], 14, 0
    )
    mask = jnp.asarray(prefix_tree_mask(shared["branch_ids"]))

    @nnx.jit  # the four forwards in one program
    def forwards(model, ids, mask, positions, chosen_ids, rejected_ids):
        return (
            model(ids, mask, positions)[0],
            model(chosen_ids)[0],
            model(rejected_ids)[0],
            model(ids, None, positions),  # without the mask
        )

    rows = np.array([p + c]), np.array([p + r])  # chosen, rejected
    outputs = forwards(model, shared["input_ids"], mask, shared["positions"], *rows)
    got, chosen, rejected, unmasked = (np.asarray(x) for x in outputs)
    np.testing.assert_allclose(got[:7], chosen, atol=1e-5)
    np.testing.assert_allclose(got[7:12], rejected[4:], atol=1e-5)
    # Without the mask the rejected branch would attend to the chosen tokens and differ.
    assert np.abs(unmasked[0, 7:12] - rejected[4:]).max() > 1e-3
    with pytest.raises(ValueError, match="explicit `positions`"):
        model(jnp.asarray(shared["input_ids"]), mask)


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32},
        {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
        {
            "factor": 2.0,
            "original_max_position_embeddings": 32,
            "mscale": 2.0,
            "mscale_all_dim": 1.0,
        },
        {"factor": None, "original_max_position_embeddings": 32},  # max_position / original
        {"factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 0.9},
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxrl.models.rope import rope_inv_freq

    config = transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **rope},
    )  # fmt: skip
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = config_from_hf(config)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(ours)), want_freq.numpy(), rtol=1e-6)
    assert ours.rope_attention_factor == pytest.approx(want_factor, rel=1e-12)
    assert not np.allclose(
        want_freq.numpy(), np.asarray(rope_inv_freq(ours.replace(rope_type="default")))
    )
