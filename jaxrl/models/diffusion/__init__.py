"""Stable Diffusion in Flax NNX: UNet, VAE, CLIP towers, diffusers-directory loading and saving,
the DDIM sampler with DDPO's per-step log-probs, UNet LoRA and the DDPO rewards."""

from jaxrl.models.diffusion.clip import CLIPConfig, CLIPTextModel, CLIPVisionModelWithProjection
from jaxrl.models.diffusion.ddim import (
    DDIMScheduler,
    Samples,
    ddim_step_with_logprob,
    decode_latents,
    guided_noise_pred,
    sample_with_logprob,
    transition_log_prob,
)
from jaxrl.models.diffusion.hf import (
    StableDiffusion,
    load_clip_text,
    load_clip_vision,
    load_pipeline,
    load_unet,
    load_vae,
    save_unet,
)
from jaxrl.models.diffusion.lora import LoRAParam, add_lora, load_lora_weights, save_lora_weights
from jaxrl.models.diffusion.rewards import (
    AestheticScorer,
    jpeg_compressibility,
    jpeg_incompressibility,
)
from jaxrl.models.diffusion.unet import UNet2DConditionModel, UNetConfig
from jaxrl.models.diffusion.vae import AutoencoderKL, VAEConfig

__all__ = [
    "AestheticScorer",
    "AutoencoderKL",
    "CLIPConfig",
    "CLIPTextModel",
    "CLIPVisionModelWithProjection",
    "DDIMScheduler",
    "LoRAParam",
    "Samples",
    "StableDiffusion",
    "UNet2DConditionModel",
    "UNetConfig",
    "VAEConfig",
    "add_lora",
    "ddim_step_with_logprob",
    "decode_latents",
    "guided_noise_pred",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "load_clip_text",
    "load_clip_vision",
    "load_lora_weights",
    "load_pipeline",
    "load_unet",
    "load_vae",
    "sample_with_logprob",
    "save_lora_weights",
    "save_unet",
    "transition_log_prob",
]
