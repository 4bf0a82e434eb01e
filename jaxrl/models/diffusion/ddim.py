"""DDIM sampling with DDPO's per-step log-probs (TRL v0.7.2 `scheduler_step` / `pipeline_step`).

`DDIMScheduler` is host-side configuration (diffusers' DDIMScheduler fields, hashable, so it can be
a static jit argument); everything that touches arrays is a pure function:

- `ddim_step_with_logprob`: one reverse step x_t -> x_{t-1} ~ N(mean, std^2) with the Gaussian
  log-density of x_{t-1} averaged over the non-batch dims (TRL: mean, not sum; no sigma floor;
  prev timestep clamped to >= 0).
- `guided_noise_pred`: classifier-free guidance with one UNet call on [uncond; cond].
- `sample_with_logprob`: the whole sampling loop as a `lax.scan`, recording what TRL's
  `_generate_samples` stores (latents, next latents, log-probs, timesteps).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.core import loops

UNetFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
SPACINGS = ("leading", "trailing", "linspace")
PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")


@dataclasses.dataclass(frozen=True)
class DDIMScheduler:
    """diffusers' DDIMScheduler config (same defaults). `from_config` accepts any SD scheduler
    config (e.g. the PNDM one SD ships), as `DDIMScheduler.from_config` does in TRL."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    clip_sample: bool = True
    set_alpha_to_one: bool = True
    steps_offset: int = 0
    prediction_type: str = "epsilon"
    thresholding: bool = False
    clip_sample_range: float = 1.0
    timestep_spacing: str = "leading"
    rescale_betas_zero_snr: bool = False

    def __post_init__(self):
        if self.beta_schedule not in BETA_SCHEDULES and self.trained_betas is None:
            raise ValueError(f"beta_schedule={self.beta_schedule!r}: use one of {BETA_SCHEDULES}.")
        if self.timestep_spacing not in SPACINGS:
            raise ValueError(f"timestep_spacing={self.timestep_spacing!r}: use one of {SPACINGS}.")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"prediction_type={self.prediction_type!r}: use one of {PREDICTION_TYPES}."
            )
        if self.thresholding:
            raise ValueError(
                "DDIM thresholding=True (dynamic thresholding) is not supported; SD checkpoints "
                "use thresholding=False."
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DDIMScheduler:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if kwargs.get("trained_betas") is not None:
            kwargs["trained_betas"] = tuple(kwargs["trained_betas"])
        return cls(**kwargs)

    def alphas_cumprod(self) -> np.ndarray:
        """[num_train_timesteps] f32, computed as diffusers does (f32 betas)."""
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = np.asarray(self.trained_betas, np.float32)
        elif self.beta_schedule == "linear":
            betas = np.linspace(self.beta_start, self.beta_end, n, dtype=np.float32)
        elif self.beta_schedule == "scaled_linear":
            betas = np.linspace(self.beta_start**0.5, self.beta_end**0.5, n, dtype=np.float32) ** 2
        else:

            def alpha_bar(t: float) -> float:
                return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

            betas = np.array(
                [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)],
                np.float32,
            )
        if self.rescale_betas_zero_snr:
            betas = _rescale_zero_terminal_snr(betas)
        # torch's f32 cumprod accumulates in double on CPU; so do we, for bit-equal alphas.
        return np.cumprod((1.0 - betas).astype(np.float64)).astype(np.float32)

    def timesteps(self, num_inference_steps: int) -> np.ndarray:
        """diffusers `set_timesteps`: [num_inference_steps] int32, descending."""
        n = self.num_train_timesteps
        if num_inference_steps > n:
            raise ValueError(f"num_inference_steps={num_inference_steps} > {n} train timesteps.")
        if self.timestep_spacing == "linspace":
            t = np.linspace(0, n - 1, num_inference_steps).round()[::-1]
        elif self.timestep_spacing == "leading":
            ratio = n // num_inference_steps
            t = (np.arange(num_inference_steps) * ratio).round()[::-1] + self.steps_offset
        else:
            t = np.round(np.arange(n, 0, -n / num_inference_steps)) - 1
        return t.astype(np.int32)


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    # Lin et al. 2023, Algorithm 1 (diffusers `rescale_zero_terminal_snr`).
    sqrt_bar = np.sqrt(np.cumprod(1.0 - betas, dtype=np.float32))
    first, last = sqrt_bar[0].copy(), sqrt_bar[-1].copy()
    sqrt_bar = (sqrt_bar - last) * (first / (first - last))
    bar = sqrt_bar**2
    alphas = np.concatenate([bar[:1], bar[1:] / bar[:-1]])
    return (1 - alphas).astype(np.float32)


def _left_broadcast(x_B: jax.Array, ndim: int) -> jax.Array:
    return x_B.reshape(x_B.shape + (1,) * (ndim - x_B.ndim))


class StepOutput(NamedTuple):
    prev_sample: jax.Array  # x_{t-1}, sample's dtype
    log_prob: jax.Array  # [B] mean log-density of x_{t-1}
    prev_sample_mean: jax.Array
    std_dev: jax.Array  # [B] sigma_t


def ddim_step_with_logprob(
    scheduler: DDIMScheduler,
    num_inference_steps: int,
    model_output: jax.Array,
    timestep: jax.Array,
    sample: jax.Array,
    eta: float | jax.Array,
    *,
    prev_sample: jax.Array | None = None,
    key: jax.Array | None = None,
    noise: jax.Array | None = None,
) -> StepOutput:
    """One DDIM step and the log-prob of its result (TRL v0.7.2 `scheduler_step`).

    `timestep` is a scalar or a [B] vector. Give `prev_sample` to score a given x_{t-1} (training),
    or `key` to draw it (sampling), or the standard-normal `noise` of the draw; exactly one.
    """
    if sum(x is not None for x in (prev_sample, key, noise)) != 1:
        raise ValueError("ddim_step_with_logprob: pass exactly one of prev_sample, key and noise.")
    n = scheduler.num_train_timesteps
    alphas_cumprod = jnp.asarray(scheduler.alphas_cumprod())
    b = sample.shape[0]
    t_B = jnp.broadcast_to(jnp.asarray(timestep, jnp.int32), (b,))
    # TRL clamps the previous timestep at 0, so the last step uses alphas_cumprod[0] (never
    # final_alpha_cumprod, even with set_alpha_to_one=True).
    prev_B = jnp.clip(t_B - n // num_inference_steps, 0, n - 1)
    a_t = _left_broadcast(alphas_cumprod[t_B], sample.ndim)
    a_prev = _left_broadcast(alphas_cumprod[prev_B], sample.ndim)
    x = sample.astype(jnp.float32)
    out = model_output.astype(jnp.float32)
    beta_t = 1 - a_t
    if scheduler.prediction_type == "epsilon":
        x0 = (x - jnp.sqrt(beta_t) * out) / jnp.sqrt(a_t)
        eps = out
    elif scheduler.prediction_type == "sample":
        x0 = out
        eps = (x - jnp.sqrt(a_t) * x0) / jnp.sqrt(beta_t)
    else:
        x0 = jnp.sqrt(a_t) * x - jnp.sqrt(beta_t) * out
        eps = jnp.sqrt(a_t) * out + jnp.sqrt(beta_t) * x
    if scheduler.clip_sample:
        x0 = jnp.clip(x0, -scheduler.clip_sample_range, scheduler.clip_sample_range)
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std = eta * jnp.sqrt(variance)
    mean = jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev - std**2) * eps
    if key is not None:
        noise = jax.random.normal(key, mean.shape, jnp.float32)
    if prev_sample is None:
        prev_sample = mean + std * noise
    target = jax.lax.stop_gradient(prev_sample.astype(jnp.float32))
    log_prob = (
        -jnp.square(target - mean) / (2 * std**2) - jnp.log(std) - 0.5 * math.log(2 * math.pi)
    )
    log_prob_B = jnp.mean(log_prob, axis=tuple(range(1, log_prob.ndim)))
    return StepOutput(prev_sample.astype(sample.dtype), log_prob_B, mean, std.reshape(b))


def guided_noise_pred(
    unet_fn: UNetFn,
    latents: jax.Array,
    timestep: jax.Array,
    prompt_embeds: jax.Array,
    negative_prompt_embeds: jax.Array | None,
    guidance_scale: float | jax.Array,
) -> jax.Array:
    """uncond + scale * (cond - uncond) from one UNet call on [latents; latents] with
    [negative; prompt] embeddings (TRL/diffusers order), or the plain prediction without
    `negative_prompt_embeds`."""
    if negative_prompt_embeds is None:
        return unet_fn(latents, timestep, prompt_embeds)
    b = latents.shape[0]
    t = jnp.broadcast_to(jnp.asarray(timestep), (b,))
    noise = unet_fn(
        jnp.concatenate([latents, latents]),
        jnp.concatenate([t, t]),
        jnp.concatenate([negative_prompt_embeds, prompt_embeds]),
    )
    uncond, cond = noise[:b], noise[b:]
    return uncond + guidance_scale * (cond - uncond)


class Samples(NamedTuple):
    """What TRL's `_generate_samples` records per image (step axis 1)."""

    latents: jax.Array  # [B, S, C, H, W]   x_t fed to each step
    next_latents: jax.Array  # [B, S, C, H, W]   x_{t-1} it produced
    log_probs: jax.Array  # [B, S]
    timesteps: jax.Array  # [B, S]
    final_latents: jax.Array  # [B, C, H, W]  (decode with `decode_latents`)


def sample_with_logprob(
    unet_fn: UNetFn,
    scheduler: DDIMScheduler,
    prompt_embeds: jax.Array,
    negative_prompt_embeds: jax.Array | None,
    key: jax.Array,
    *,
    latent_shape: tuple[int, int, int],
    num_inference_steps: int = 50,
    guidance_scale: float = 5.0,
    eta: float = 1.0,
    initial_latents: jax.Array | None = None,
    step_noise: jax.Array | None = None,
) -> Samples:
    """DDPO's sampler (TRL `pipeline_step`) as one `lax.scan` over the DDIM timesteps.

    Guidance is applied when `guidance_scale > 1` (diffusers' rule), with
    `negative_prompt_embeds` as the unconditional branch. Initial latents are standard normal
    (DDIM's init_noise_sigma is 1) drawn from `key` unless given; `step_noise`
    [steps, B, C, H, W] replaces the per-step draws (to replay a reference trajectory).
    """
    b = prompt_embeds.shape[0]
    init_key, step_key = jax.random.split(key)
    if initial_latents is None:
        initial_latents = jax.random.normal(init_key, (b, *latent_shape), jnp.float32)
    use_cfg = guidance_scale > 1.0
    if use_cfg and negative_prompt_embeds is None:
        raise ValueError("guidance_scale > 1 needs negative_prompt_embeds (the empty prompt's).")
    timesteps = jnp.asarray(scheduler.timesteps(num_inference_steps))

    def step(latents, xs):
        t, k, noise_draw = xs
        noise = guided_noise_pred(
            unet_fn,
            latents,
            t,
            prompt_embeds,
            negative_prompt_embeds if use_cfg else None,
            guidance_scale,
        )
        out = ddim_step_with_logprob(
            scheduler,
            num_inference_steps,
            noise,
            t,
            latents,
            eta,
            key=k if noise_draw is None else None,
            noise=noise_draw,
        )
        return out.prev_sample, (latents, out.prev_sample, out.log_prob)

    keys = jax.random.split(step_key, num_inference_steps)
    xs = (timesteps, keys, step_noise)
    final, (lat, nxt, logp) = loops.scan(step, initial_latents, xs)
    return Samples(
        latents=jnp.swapaxes(lat, 0, 1),
        next_latents=jnp.swapaxes(nxt, 0, 1),
        log_probs=jnp.swapaxes(logp, 0, 1),
        timesteps=jnp.broadcast_to(timesteps, (b, num_inference_steps)),
        final_latents=final,
    )


def decode_latents(
    decode_fn: Callable[[jax.Array], jax.Array], latents: jax.Array, scaling_factor: float
) -> jax.Array:
    """Images in [0, 1] (diffusers' `output_type="pt"` postprocessing) from UNet latents."""
    images = decode_fn(latents / scaling_factor)
    return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)


def transition_log_prob(
    unet_fn: UNetFn,
    scheduler: DDIMScheduler,
    num_inference_steps: int,
    latents: jax.Array,
    timesteps_B: jax.Array,
    next_latents: jax.Array,
    prompt_embeds: jax.Array,
    negative_prompt_embeds: jax.Array | None,
    *,
    guidance_scale: float = 5.0,
    eta: float = 1.0,
) -> jax.Array:
    """[B] log-prob under the current UNet of a recorded step latents -> next_latents (the first
    half of TRL's `calculate_loss`). With `negative_prompt_embeds` (train_cfg=True) guidance is
    always applied with `guidance_scale` (TRL's `sample_guidance_scale`), as TRL does."""
    noise = guided_noise_pred(
        unet_fn, latents, timesteps_B, prompt_embeds, negative_prompt_embeds, guidance_scale
    )
    out = ddim_step_with_logprob(
        scheduler, num_inference_steps, noise, timesteps_B, latents, eta, prev_sample=next_latents
    )
    return out.log_prob
