"""DDPO rewards: JPEG (in)compressibility, CLIP vision parity with transformers, and the LAION
aesthetic predictor loaded from a PyTorch state dict (TRL `AestheticScorer` as the reference)."""

from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jaxrl.models.diffusion import load_clip_vision
from jaxrl.models.diffusion.rewards import (
    AestheticScorer,
    jpeg_compressibility,
    jpeg_incompressibility,
    jpeg_size_kb,
    load_aesthetic_mlp,
)
from tests.model_calls import jit_call

VISION = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    projection_dim=12,
)


def test_jpeg_rewards_quantise_like_trl():
    rng = np.random.default_rng(0)
    noisy = rng.uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
    flat = np.full((1, 3, 32, 32), 0.5, np.float32)
    images = np.concatenate([noisy, flat])
    inc, meta = jpeg_incompressibility(images, ["a", "b"], [{}, {}])
    comp, _ = jpeg_compressibility(images)
    assert meta == {}
    np.testing.assert_array_equal(comp, -inc)
    assert inc[0] > 2 * inc[1]
    # 0.5 * 255 = 127.5 rounds (half to even, as torch.round) to 128, not truncated to 127.
    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buffer, format="JPEG", quality=95)
    assert jpeg_size_kb(flat)[0] == pytest.approx(buffer.tell() / 1000)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip_vision")
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(**VISION)
    model = transformers.CLIPVisionModelWithProjection(config).eval()
    model.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(path)
    return model, path


def test_clip_vision_matches_transformers(clip_dir):
    ref, path = clip_dir
    pixels = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        want = ref(pixel_values=torch.from_numpy(pixels)).image_embeds.numpy()
    ours = jit_call(load_clip_vision(path), jnp.asarray(pixels))
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-4)


def torch_aesthetic_mlp(dim: int) -> torch.nn.Sequential:
    # TRL examples/scripts/ddpo.py MLP layout (Dropout between the Linear layers).
    return torch.nn.Sequential(
        torch.nn.Linear(dim, 1024),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1),
    ).eval()


class TorchMLP(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = torch_aesthetic_mlp(dim)


def test_aesthetic_scorer_matches_torch_reference(clip_dir, tmp_path):
    ref_clip, path = clip_dir
    torch.manual_seed(1)
    mlp = TorchMLP(VISION["projection_dim"]).eval()
    torch.save(mlp.state_dict(), tmp_path / "aesthetic.pth")

    images = np.random.default_rng(2).uniform(0, 1, (2, 3, 40, 48)).astype(np.float32)
    # TRL AestheticScorer: uint8 images -> CLIPProcessor -> get_image_features -> L2 norm -> MLP.
    processor = transformers.CLIPImageProcessor.from_pretrained(path)
    uint8 = (torch.from_numpy(images) * 255).round().clamp(0, 255).to(torch.uint8)
    with torch.no_grad():
        pixels = processor(images=uint8, return_tensors="pt")["pixel_values"]
        embed = ref_clip(pixel_values=pixels).image_embeds
        embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        want = mlp.layers(embed).squeeze(1).numpy()

    scorer = AestheticScorer(path, tmp_path / "aesthetic.pth")
    scores, meta = scorer(images, ["p", "q"], [{}, {}])
    assert meta == {}
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_aesthetic_loader_rejects_other_state_dicts(tmp_path):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(KeyError, match="aesthetic-predictor"):
        load_aesthetic_mlp(tmp_path / "other.pth")
