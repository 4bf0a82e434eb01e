"""The package's tiny random Stable Diffusion pipeline, shipped as a diffusers directory.

DDPO's embedded CLI job, its bench and its tests need an SD pipeline without a hub download, and
the base install has no torch: the pipeline ships in `jaxrl/assets/tiny_sd/` (safetensors
weights and JSON configs, 0.6 MB), which `tiny_pipeline()` returns. SD 1.x layout: UNet 8x8
latents, channels (8, 16), CLIP text width 16, a 20-token CLIP tokenizer over a small word list,
a DDIM scheduler with SD's betas. The same directory loads into diffusers and TRL v0.7.2's
pipeline, so benches compare like with like.

The configs below are plain data (no imports beyond the standard library at module level, so the
TRL v0.7.2 golden script can load this file by path). They are the recipe of the shipped files:
`tests/assets/make_tiny_sd.py` builds the pipeline from them with diffusers/transformers (PyTorch,
seeded) and rewrites the assets; a test checks that the shipped weights equal a fresh build.
Shipping the files rather than initialising them in JAX keeps the weights byte-identical to the
torch-built pipeline that every DDPO number in BENCHMARKS.md was measured on.

The VAE has SD's four blocks, so latents decode 8x larger: 64x64 images. (An earlier version had
two blocks and 16x16 images, whose JPEG files are almost all header: their sizes varied by ~6
bytes, and DDPO's JPEG rewards hardly moved. At 64x64 they vary by ~60 bytes and the CLI's reward
rises.)
"""

from __future__ import annotations

from pathlib import Path

WORDS = ("a", "photo", "of", "cat", "dog", "horse", "bird", "fish", "red", "blue", "green")
UNET = dict(
    block_out_channels=(8, 16),
    layers_per_block=1,
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=16,
    attention_head_dim=2,
    norm_num_groups=4,
)
VAE = dict(
    block_out_channels=(8, 16, 16, 16),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    norm_num_groups=4,
    layers_per_block=1,
)
CLIP_TEXT = dict(
    bos_token_id=0,
    eos_token_id=1,
    hidden_size=16,
    intermediate_size=37,
    layer_norm_eps=1e-5,
    num_attention_heads=4,
    num_hidden_layers=2,
    pad_token_id=1,
    max_position_embeddings=20,
)
# SD's DDIM settings (diffusers DDIMScheduler kwargs).
SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)


# The shipped pipeline directory (package data, so an installed wheel has it too).
TINY_SD_DIR = Path(__file__).resolve().parents[2] / "assets" / "tiny_sd"


def tiny_pipeline() -> Path:
    """Path of the package's tiny SD pipeline directory (read-only package data)."""
    return TINY_SD_DIR


TINY_PROMPTS = tuple(f"a photo of a {w}" for w in ("cat", "dog", "horse", "bird", "fish"))
