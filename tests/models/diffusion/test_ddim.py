"""DDIM step with log-prob, the CFG sampler and DDPO's loss against TRL v0.7.2 golden numbers
(tests/golden/ddpo_trl072.json, made by examples/golden_ddpo_trl072.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.losses.ddpo import ddpo_loss
from jaxrl.models.diffusion import load_unet, load_vae
from jaxrl.models.diffusion.ddim import (
    DDIMScheduler,
    ddim_step_with_logprob,
    decode_latents,
    guided_noise_pred,
    sample_with_logprob,
    transition_log_prob,
)

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = json.loads((ROOT / "tests/golden/ddpo_trl072.json").read_text())
UPDATE = "regenerate with `/work/.peer-trl072/bin/python examples/golden_ddpo_trl072.py`"


def _recipe():
    spec = importlib.util.spec_from_file_location(
        "golden_ddpo", ROOT / "examples/golden_ddpo_trl072.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPE = _recipe()
INPUTS = RECIPE.make_inputs()
SCHED = DDIMScheduler.from_config(GOLDEN["scheduler"])
STEPS = GOLDEN["num_inference_steps"]


def _save(model: torch.nn.Module, seed: int, path: Path) -> None:
    weights = RECIPE.fill_weights(model.state_dict(), seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden_sd")
    _save(diffusers.UNet2DConditionModel(**RECIPE.UNET), 0, path / "unet")
    _save(diffusers.AutoencoderKL(**RECIPE.VAE), 1, path / "vae")
    return load_unet(path / "unet"), load_vae(path / "vae")


def unet_fn_of(graphdef, state):
    def fn(x, t, c):
        return nnx.merge(graphdef, state)(x, t, c)

    return fn


def test_recipe_is_the_recorded_one():
    """The recipe's model configs are the ones the golden was recorded with."""
    for name, config in (("unet", RECIPE.UNET), ("vae", RECIPE.VAE)):
        assert json.loads(json.dumps(config)) == GOLDEN[name], f"{name}: {UPDATE}"


def test_timesteps_match_diffusers():
    assert SCHED.timesteps(STEPS).tolist() == GOLDEN["timesteps"]
    ref = diffusers.DDIMScheduler(**GOLDEN["scheduler"])
    np.testing.assert_allclose(SCHED.alphas_cumprod(), ref.alphas_cumprod.numpy(), rtol=1e-6)
    for spacing in ("trailing", "linspace"):
        ref = diffusers.DDIMScheduler(**GOLDEN["scheduler"], timestep_spacing=spacing)
        ref.set_timesteps(7)
        ours = DDIMScheduler.from_config({**GOLDEN["scheduler"], "timestep_spacing": spacing})
        assert ours.timesteps(7).tolist() == ref.timesteps.tolist()


@pytest.mark.parametrize("case", GOLDEN["step_cases"], ids=lambda c: f"t{c['timesteps']}")
def test_step_log_prob_and_mean_match_trl(case):
    args = (SCHED, STEPS, INPUTS["model_output"], jnp.asarray(case["timesteps"]), INPUTS["sample"])
    scored = ddim_step_with_logprob(*args, case["eta"], prev_sample=INPUTS["prev_sample"])
    np.testing.assert_allclose(
        scored.log_prob, case["log_prob"], rtol=1e-5, atol=1e-4, err_msg=UPDATE
    )
    np.testing.assert_allclose(scored.prev_sample_mean, case["prev_sample_mean"], atol=1e-5)
    # Drawing with zero noise gives the mean; scoring the mean gives the Gaussian's peak density.
    drawn = ddim_step_with_logprob(*args, case["eta"], noise=np.zeros_like(INPUTS["sample"]))
    np.testing.assert_allclose(drawn.prev_sample, case["prev_sample_mean"], atol=1e-5)
    peak = -np.log(np.asarray(drawn.std_dev)) - 0.5 * np.log(2 * np.pi)
    # rtol: float32 against float64; the drawn and the rescored mean may round differently
    # (~1e-7 relative), which the small variance at a timestep amplifies to ~3e-6.
    np.testing.assert_allclose(drawn.log_prob, peak, rtol=1e-5)


def test_step_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one"):
        ddim_step_with_logprob(SCHED, STEPS, INPUTS["model_output"], 901, INPUTS["sample"], 1.0)


@pytest.mark.slow
def test_cfg_noise_pred_matches_trl(golden_models):
    unet, _ = golden_models
    graphdef, state = nnx.split(unet)
    neg = np.repeat(INPUTS["negative_prompt_embeds"], 2, axis=0)
    noise = jax.jit(
        lambda s: guided_noise_pred(
            unet_fn_of(graphdef, s),
            INPUTS["initial_latents"],
            GOLDEN["timesteps"][0],
            INPUTS["prompt_embeds"],
            neg,
            GOLDEN["guidance_scale"],
        )
    )(state)
    np.testing.assert_allclose(noise, GOLDEN["cfg_noise_pred_step0"], atol=1e-4, err_msg=UPDATE)


@pytest.mark.slow
def test_sampler_replays_trl_trajectory(golden_models):
    unet, vae = golden_models
    graphdef, state = nnx.split(unet)
    neg = np.repeat(INPUTS["negative_prompt_embeds"], 2, axis=0)

    @jax.jit
    def run(s):
        return sample_with_logprob(
            unet_fn_of(graphdef, s),
            SCHED,
            INPUTS["prompt_embeds"],
            neg,
            jax.random.key(0),
            latent_shape=(4, 8, 8),
            num_inference_steps=STEPS,
            guidance_scale=GOLDEN["guidance_scale"],
            eta=GOLDEN["eta"],
            initial_latents=INPUTS["initial_latents"],
            step_noise=INPUTS["step_noise"],
        )

    out = run(state)
    all_latents = np.asarray(GOLDEN["all_latents"])
    np.testing.assert_allclose(out.latents, all_latents[:, :-1], atol=1e-4, err_msg=UPDATE)
    np.testing.assert_allclose(out.next_latents, all_latents[:, 1:], atol=1e-4)
    np.testing.assert_allclose(out.log_probs, GOLDEN["all_log_probs"], atol=1e-4)
    assert out.timesteps.shape == (2, STEPS)
    assert out.timesteps[1].tolist() == GOLDEN["timesteps"]
    images = nnx.jit(lambda m, z: decode_latents(m.decode, z, 0.18215))(vae, out.final_latents)
    np.testing.assert_allclose(images, GOLDEN["images"], atol=1e-4)


@pytest.mark.slow
def test_sampler_draws_are_scored_consistently(golden_models):
    """Without replayed noise: each recorded step links to the next, and re-scoring a recorded
    transition with the same params gives the recorded log-prob (ratio 1 at the first update)."""
    unet, _ = golden_models
    graphdef, state = nnx.split(unet)
    neg = np.repeat(INPUTS["negative_prompt_embeds"], 2, axis=0)

    @jax.jit
    def run(s, k):
        fn = unet_fn_of(graphdef, s)
        out = sample_with_logprob(
            fn,
            SCHED,
            INPUTS["prompt_embeds"],
            neg,
            k,
            latent_shape=(4, 8, 8),
            num_inference_steps=3,
            guidance_scale=5.0,
            eta=1.0,
        )
        rescored = transition_log_prob(
            fn,
            SCHED,
            3,
            out.latents[:, 1],
            out.timesteps[:, 1],
            out.next_latents[:, 1],
            INPUTS["prompt_embeds"],
            neg,
            guidance_scale=5.0,
            eta=1.0,
        )
        return out, rescored

    out, rescored = run(state, jax.random.key(1))
    np.testing.assert_array_equal(out.latents[:, 1:], out.next_latents[:, :-1])
    np.testing.assert_array_equal(out.next_latents[:, -1], out.final_latents)
    np.testing.assert_allclose(rescored, out.log_probs[:, 1], atol=1e-5)
    other, _ = run(state, jax.random.key(2))
    assert not np.allclose(other.final_latents, out.final_latents)


@pytest.mark.parametrize("case", GOLDEN["loss_cases"], ids=lambda c: f"step{c['step']}")
def test_calculate_loss_matches_trl(golden_models, case):
    unet, _ = golden_models
    graphdef, state = nnx.split(unet)
    all_latents = np.asarray(GOLDEN["all_latents"], np.float32)
    j = case["step"]
    neg = np.repeat(INPUTS["negative_prompt_embeds"], 2, axis=0) if case["train_cfg"] else None

    @jax.jit
    def loss_fn(s):
        logp = transition_log_prob(
            unet_fn_of(graphdef, s),
            SCHED,
            STEPS,
            all_latents[:, j],
            jnp.full((2,), GOLDEN["timesteps"][j]),
            all_latents[:, j + 1],
            INPUTS["prompt_embeds"],
            neg,
            guidance_scale=GOLDEN["guidance_scale"],
            eta=GOLDEN["eta"],
        )
        return ddpo_loss(
            logp,
            jnp.asarray(case["old_log_probs"]),
            jnp.asarray(case["advantages"]),
            clip_range=1e-4,
            adv_clip_max=5.0,
        )

    out = loss_fn(state)
    np.testing.assert_allclose(out.loss, case["loss"], rtol=1e-4, atol=1e-4, err_msg=UPDATE)
    np.testing.assert_allclose(out.approx_kl, case["approx_kl"], rtol=1e-3, atol=1e-9)
    assert float(out.clipfrac) == case["clipfrac"]
