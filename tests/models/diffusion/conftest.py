"""Tiny random diffusers / transformers (PyTorch) Stable Diffusion parts, saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jaxrl.models.diffusion import tiny


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random offsets on biases and norm params (which start at 0 / 1), so their mapping is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


# The package's tiny pipeline configs, with a cross-attention width (12) unlike any channel count
# so a mixed-up dimension fails loudly.
UNET_SD1 = dict(tiny.UNET, cross_attention_dim=12)
# SD 2.x flavour: linear projections, per-block head counts, upcast attention, 2 layers / block.
UNET_SD2 = dict(
    UNET_SD1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=2,
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    upcast_attention=True,
)
VAE = tiny.VAE
# Distinct eos / pad ids (the tiny pipeline shares one) and a round vocabulary.
CLIP_TEXT = dict(tiny.CLIP_TEXT, eos_token_id=2, vocab_size=100)


def build_unet(kwargs: dict, seed: int, path: Path, **save) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(seed)
    unet = perturb(diffusers.UNet2DConditionModel(**kwargs), seed)
    unet.save_pretrained(path, **save)
    return unet


@pytest.fixture(scope="session")
def sd1_unet(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet_sd1")
    return build_unet(UNET_SD1, 0, path), path


@pytest.fixture(scope="session")
def sd2_unet(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet_sd2")
    return build_unet(UNET_SD2, 1, path, safe_serialization=False), path


@pytest.fixture(scope="session")
def tiny_vae(tmp_path_factory):
    import diffusers

    path = tmp_path_factory.mktemp("vae")
    torch.manual_seed(2)
    vae = perturb(diffusers.AutoencoderKL(**VAE), 2)
    vae.save_pretrained(path)
    return vae, path


@pytest.fixture(scope="session")
def tiny_clip_text(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("clip_text")
    torch.manual_seed(3)
    model = perturb(transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP_TEXT)), 3)
    model.save_pretrained(path, safe_serialization=False)
    return model, path
