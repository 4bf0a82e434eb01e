"""UNet LoRA (TRL v0.7.2 DDPO's rank-4 attention adapters): identity at init, diffusers-format
export that `StableDiffusionPipeline.load_lora_weights` reproduces, reload, and training split."""

from __future__ import annotations

import functools

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.models.diffusion import load_unet, save_unet
from jaxrl.models.diffusion.lora import (
    LoRAParam,
    add_lora,
    attention_modules,
    load_lora_weights,
    lora_state_dict,
    save_lora_weights,
)
from jaxrl.models.weights_io import SafetensorsFile


@nnx.jit
def run_unet(unet, sample, t, context):
    return unet(sample, t, context)


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        np.array([10, 981]),
        rng.standard_normal((2, 5, 12)).astype(np.float32),
    )


@functools.cache
def _loaded(path):
    return load_unet(path)


def base_unet(path):
    """A fresh copy of `load_unet(path)` (add_lora and load_lora_weights change the UNet in
    place): the load, which traces the UNet's constructor (~2 s), is done once per path."""
    return nnx.clone(_loaded(path))


def randomize_up(unet, seed: int = 0) -> None:
    key = jax.random.key(seed)
    for path, param in nnx.to_flat_state(nnx.state(unet, LoRAParam)):
        if path[-1] == "up":
            key, sub = jax.random.split(key)
            param[...] = 0.3 * jax.random.normal(sub, param.shape)


@pytest.fixture(scope="module")
def lora_unet(sd1_unet):
    _, path = sd1_unet
    unet = add_lora(base_unet(path), rank=4, seed=0)
    randomize_up(unet)
    return unet


def test_add_lora_targets_and_identity_init(sd1_unet):
    ref, path = sd1_unet
    base = base_unet(path)
    x = inputs()
    want = np.asarray(run_unet(base, *x))
    unet = add_lora(base, rank=4)
    flat = nnx.to_flat_state(nnx.state(unet, LoRAParam))
    n_attn = len(attention_modules(unet))
    # One adapter set per diffusers attention processor (TRL's get_trainable_layers).
    assert n_attn == len(ref.attn_processors) == 8
    assert len(flat) == n_attn * 4 * 2
    for path, p in flat:
        if path[-1] == "up":
            assert p.shape[0] == 4 and not np.any(np.asarray(p[...]))
        else:
            assert p.shape[1] == 4 and np.any(np.asarray(p[...]))
    # Cross-attention k/v adapters read the text embeddings (cross_attention_dim 12).
    attn2 = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    assert attn2.to_k.lora.down.shape == (12, 4)
    np.testing.assert_allclose(np.asarray(run_unet(unet, *x)), want, atol=1e-6)
    with pytest.raises(ValueError, match="already"):
        add_lora(unet)


def test_export_matches_diffusers_load_lora_weights(sd1_unet, tiny_vae, lora_unet, tmp_path):
    ref, path = sd1_unet
    x = inputs(1)
    ours = np.asarray(run_unet(lora_unet, *x))
    save_lora_weights(lora_unet, tmp_path)
    pipe = diffusers.StableDiffusionPipeline(
        vae=tiny_vae[0],
        text_encoder=None,
        tokenizer=None,
        unet=diffusers.UNet2DConditionModel.from_pretrained(path).eval(),
        scheduler=diffusers.DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.load_lora_weights(tmp_path)
    with torch.no_grad():
        torch_args = [torch.from_numpy(a) for a in x]
        want = pipe.unet(*torch_args).sample.numpy()
        base = ref(*torch_args).sample.numpy()
    assert np.abs(want - base).max() > 1e-2  # the adapters change the output
    np.testing.assert_allclose(ours, want, atol=1e-4)


@pytest.mark.slow
def test_reload_peft_and_trl_formats(sd1_unet, lora_unet, tmp_path):
    _, path = sd1_unet
    x = inputs(2)
    want = np.asarray(run_unet(lora_unet, *x))
    save_lora_weights(lora_unet, tmp_path / "peft")
    reloaded = load_lora_weights(base_unet(path), tmp_path / "peft")
    np.testing.assert_allclose(np.asarray(run_unet(reloaded, *x)), want, atol=1e-6)

    # TRL 0.7.2 saves with `unet.save_attn_procs` (attention-processor key names).
    legacy = {}
    for key, value in lora_state_dict(lora_unet).items():
        module, proj = key.removeprefix("unet.").rsplit(".lora_", 1)[0].split(".to_", 1)
        proj = {"out.0": "out"}.get(proj, proj)
        which = "down" if ".lora_A." in key else "up"
        legacy[f"{module}.processor.to_{proj}_lora.{which}.weight"] = torch.from_numpy(value.copy())
    torch.save(legacy, tmp_path / "pytorch_lora_weights.bin")
    old = load_lora_weights(base_unet(path), tmp_path / "pytorch_lora_weights.bin")
    np.testing.assert_allclose(np.asarray(run_unet(old, *x)), want, atol=1e-6)


def test_save_unet_leaves_adapters_out(sd1_unet, lora_unet, tmp_path):
    _, path = sd1_unet
    save_unet(lora_unet, tmp_path / "unet")
    saved = set(SafetensorsFile(tmp_path / "unet/diffusion_pytorch_model.safetensors").keys())
    base = set(SafetensorsFile(path / "diffusion_pytorch_model.safetensors").keys())
    assert saved == base


@pytest.mark.slow
def test_gradients_flow_only_to_adapters(lora_unet):
    graphdef, lora, rest = nnx.split(lora_unet, LoRAParam, ...)
    x = inputs(3)

    def loss(lora_state):
        out = nnx.merge(graphdef, lora_state, rest)(*x)
        return jnp.mean(out**2)

    grads = jax.jit(jax.grad(loss))(lora)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(lora))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
