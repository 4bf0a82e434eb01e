"""Stable Diffusion in Flax NNX: UNet, VAE, CLIP towers, diffusers-directory loading and saving,
the DDIM sampler with DDPO's per-step log-probs, UNet LoRA and the DDPO rewards."""

from jaxrl.models.diffusion.clip import CLIPConfig, CLIPTextModel, CLIPVisionModelWithProjection
from jaxrl.models.diffusion.hf import (
    StableDiffusion,
    load_clip_text,
    load_clip_vision,
    load_pipeline,
    load_unet,
    load_vae,
    save_unet,
)
from jaxrl.models.diffusion.unet import UNet2DConditionModel, UNetConfig
from jaxrl.models.diffusion.vae import AutoencoderKL, VAEConfig

__all__ = [
    "AutoencoderKL",
    "CLIPConfig",
    "CLIPTextModel",
    "CLIPVisionModelWithProjection",
    "StableDiffusion",
    "UNet2DConditionModel",
    "UNetConfig",
    "VAEConfig",
    "load_clip_text",
    "load_clip_vision",
    "load_pipeline",
    "load_unet",
    "load_vae",
    "save_unet",
]
