"""UNet / VAE / CLIP text parity with diffusers and transformers (PyTorch) on tiny random models,
and the UNet save -> diffusers load round trip."""

from __future__ import annotations

import functools

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl import parallel
from jaxrl.models.diffusion import load_clip_text, load_unet, load_vae, save_unet
from tests.model_calls import jit_call


def unet_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    t = np.array([10, 981], np.int64)
    context = rng.standard_normal((2, 5, 12)).astype(np.float32)
    return sample, t, context


@nnx.jit
def run_unet(unet, sample, t, context):
    return unet(sample, t, context)


# One jitted VAE decode for the module's tests (the text encoder's call: `jit_call`): a new
# lambda per call site would trace and compile the same program again.
vae_decode = nnx.jit(lambda m, z: m.decode(z))


@functools.cache
def loaded_unet(path):
    """`load_unet(path)` (f32, one device) once per path in this module's process: each load
    traces the UNet's constructor abstractly (~2 s). The tests only read it."""
    return load_unet(path)


@functools.cache
def loaded_vae(path):
    """`load_vae(path)` once per path, as `loaded_unet`."""
    return load_vae(path)


@functools.cache
def loaded_unet_out(path, seed: int = 0) -> np.ndarray:
    """`loaded_unet(path)` on `unet_inputs(seed)`."""
    return np.asarray(run_unet(loaded_unet(path), *unet_inputs(seed)))


def torch_unet(model, sample, t, context) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context))
    return out.sample.numpy()


@pytest.mark.parametrize("flavour", ["sd1_unet", "sd2_unet"])
@pytest.mark.slow
def test_unet_matches_diffusers(flavour, request):
    ref, path = request.getfixturevalue(flavour)
    ours = loaded_unet_out(path)
    want = torch_unet(ref, *unet_inputs())
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_unet_bf16_compute_scalar_timestep(sd1_unet):
    ref, path = sd1_unet
    sample, _, context = unet_inputs(1)
    want = torch_unet(ref, sample, np.array([500, 500]), context)
    # bf16 compute with f32 params: close, and the params stay f32.
    bf16 = load_unet(path, dtype=jnp.bfloat16)
    out = run_unet(bf16, sample, np.int32(500), context)
    assert out.dtype == jnp.bfloat16
    assert bf16.conv_in.kernel[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=0.1 * np.abs(want).max())


@pytest.mark.slow
def test_unet_loads_sharded(sd1_unet):
    _, path = sd1_unet
    mesh = parallel.make_mesh(fsdp=-1)
    unet = load_unet(path, mesh=mesh)
    kernel = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    # == the same UNet loaded onto one device (test_unet_matches_diffusers checks that one).
    want = loaded_unet_out(path)
    np.testing.assert_allclose(np.asarray(run_unet(unet, *unet_inputs())), want, atol=1e-5)


@pytest.mark.slow
def test_unet_save_roundtrip(sd2_unet, tmp_path):
    ref, path = sd2_unet
    save_unet(loaded_unet(path), tmp_path / "unet")
    back = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "unet").eval()
    sample, t, context = unet_inputs(2)
    np.testing.assert_array_equal(
        torch_unet(back, sample, t, context), torch_unet(ref, sample, t, context)
    )


def test_unet_rejects_unsupported_config(sd1_unet, tmp_path):
    import json
    import shutil

    _, path = sd1_unet
    shutil.copytree(path, tmp_path / "u")
    cfg = json.loads((tmp_path / "u" / "config.json").read_text())
    cfg["class_embed_type"] = "timestep"
    (tmp_path / "u" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="class_embed_type"):
        load_unet(tmp_path / "u")


def test_vae_matches_diffusers(tiny_vae):
    ref, path = tiny_vae
    vae = loaded_vae(path)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    latents = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(images)).latent_dist
        decoded = ref.decode(torch.from_numpy(latents)).sample.numpy()
    mean, logvar = nnx.jit(lambda m, x: m.encode(x))(vae, images)
    np.testing.assert_allclose(np.asarray(mean), dist.mean.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(logvar), dist.logvar.numpy(), atol=1e-4)
    ours = vae_decode(vae, latents)
    np.testing.assert_allclose(np.asarray(ours), decoded, atol=1e-4)


def test_clip_text_matches_transformers(tiny_clip_text):
    ref, path = tiny_clip_text
    model = load_clip_text(path)
    ids = np.random.default_rng(0).integers(3, 100, (2, 20))
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).last_hidden_state.numpy()
    ours = jit_call(model, ids)
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-4)


def _tiny_clip_tokenizer(path):
    import json

    import transformers

    words = ["a", "cat", "dog", "photo", "of"]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for w in words:
        vocab[f"{w}</w>"] = len(vocab)
    for ch in sorted(set("".join(words))):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(f"{ch}</w>", len(vocab))
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(
        str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=20
    )


def test_load_pipeline_directory(sd1_unet, tiny_vae, tiny_clip_text, tmp_path):
    import transformers

    (tmp_path / "tok").mkdir()
    tokenizer = _tiny_clip_tokenizer(tmp_path / "tok")
    unet_ref, unet_path = sd1_unet
    pipe = diffusers.StableDiffusionPipeline(
        vae=tiny_vae[0],
        text_encoder=transformers.CLIPTextModel.from_pretrained(tiny_clip_text[1]).eval(),
        tokenizer=tokenizer,
        unet=diffusers.UNet2DConditionModel.from_pretrained(unet_path).eval(),
        scheduler=diffusers.PNDMScheduler(skip_prk_steps=True, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(tmp_path / "sd")
    from jaxrl.models.diffusion import load_pipeline
    from jaxrl.models.diffusion.ddim import DDIMScheduler

    sd = load_pipeline(tmp_path / "sd")
    prompts = ["a photo of a cat", ""]
    ids = sd.tokenizer(
        prompts, padding="max_length", max_length=sd.tokenizer.model_max_length, truncation=True
    ).input_ids
    with torch.no_grad():
        want = pipe.text_encoder(torch.tensor(ids))[0].numpy()
    ours = jit_call(sd.text_encoder, np.asarray(ids))
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-4)
    ref = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    ref.set_timesteps(10)
    ddim = DDIMScheduler.from_config(sd.scheduler_config)
    assert ddim.timesteps(10).tolist() == ref.timesteps.tolist()
    assert sd.vae.config.scaling_factor == pipe.vae.config.scaling_factor
    with pytest.raises(FileNotFoundError, match="not a diffusers Stable Diffusion directory"):
        load_pipeline(tmp_path / "sd" / "unet")


def test_loader_warns_on_unused_weights_only(tiny_clip_text, tiny_vae, tmp_path):
    import shutil
    import warnings

    from safetensors.numpy import load_file, save_file

    _, clip_path = tiny_clip_text
    _, vae_path = tiny_vae
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_clip_text(clip_path)
        load_vae(vae_path)
    shutil.copytree(clip_path, tmp_path / "clip")
    weights = load_file(tmp_path / "clip" / "model.safetensors")
    weights["stray.weight"] = np.zeros(3, np.float32)
    weights["text_model.embeddings.position_ids"] = np.arange(20)[None]  # a buffer: not warned
    save_file(weights, tmp_path / "clip" / "model.safetensors")
    with pytest.warns(UserWarning, match=r"1 weight\(s\) the model does not use: stray.weight"):
        load_clip_text(tmp_path / "clip")


def test_vae_legacy_attention_names(tiny_vae, tmp_path):
    """Pre-0.14 diffusers VAEs name the mid-block attention query/key/value/proj_attn."""
    import shutil

    from safetensors.numpy import load_file, save_file

    _, path = tiny_vae
    shutil.copytree(path, tmp_path / "vae")
    weights = load_file(tmp_path / "vae" / "diffusion_pytorch_model.safetensors")
    renames = {
        ".to_q.": ".query.",
        ".to_k.": ".key.",
        ".to_v.": ".value.",
        ".to_out.0.": ".proj_attn.",
    }
    old = {}
    for key, value in weights.items():
        for new, legacy in renames.items():
            key = key.replace(new, legacy)
        old[key] = value
    assert any(".proj_attn." in k for k in old)
    save_file(old, tmp_path / "vae" / "diffusion_pytorch_model.safetensors")
    # Two latents, as test_vae_matches_diffusers: the same compiled decode.
    latents = np.random.default_rng(3).standard_normal((2, 4, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(vae_decode(load_vae(tmp_path / "vae"), latents)),
        np.asarray(vae_decode(loaded_vae(path), latents)),
    )
