"""A tiny random Stable Diffusion pipeline directory, built deterministically on first use.

The configs are plain data (no imports beyond the standard library at module level), also read
by the tests' model builders and by the TRL v0.7.2 golden script. The DDPO CLI, bench and tests
need an SD pipeline without a hub download. `tiny_pipeline()`
builds one with diffusers/transformers (PyTorch, seeded), SD 1.x layout (UNet 8x8 latents,
channels (8, 16), CLIP text width 16, a 20-token CLIP tokenizer over a small word list, a DDIM
scheduler with SD's betas), saves it with `save_pretrained` into a cache directory and returns
the path. The same directory loads into TRL v0.7.2's pipeline, so benches compare like with like.

The VAE has SD's four blocks, so latents decode 8x larger: 64x64 images. (Version v1 had two
blocks and 16x16 images, whose JPEG files are almost all header: their sizes varied by ~6 bytes,
and DDPO's JPEG rewards hardly moved. At 64x64 they vary by ~60 bytes and the CLI's reward rises.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

VERSION = "v2"
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


def default_cache_dir() -> Path:
    root = os.environ.get("JAXRL_CACHE") or os.path.join(Path.home(), ".cache", "jaxrl")
    return Path(root) / f"tiny-sd-{VERSION}"


def _tokenizer_files(directory: Path) -> int:
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for w in WORDS:
        vocab[f"{w}</w>"] = len(vocab)
    for ch in sorted(set("".join(WORDS))):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(f"{ch}</w>", len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return len(vocab)


def _build(directory: Path) -> None:
    import diffusers
    import torch
    import transformers

    tok_dir = directory / "_tok"
    tok_dir.mkdir(parents=True)
    vocab_size = _tokenizer_files(tok_dir)
    tokenizer = transformers.CLIPTokenizer(
        str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"), model_max_length=20
    )
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**UNET)
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKL(**VAE)
    torch.manual_seed(2)
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(**CLIP_TEXT, vocab_size=vocab_size)
    )
    scheduler = diffusers.DDIMScheduler(**SCHEDULER)
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(directory, safe_serialization=True)
    # transformers 5 writes only tokenizer.json; older versions (TRL v0.7.2's 4.36) load the
    # slow CLIP tokenizer from vocab.json + merges.txt, so ship those too.
    for name in ("vocab.json", "merges.txt"):
        shutil.move(tok_dir / name, directory / "tokenizer" / name)
    shutil.rmtree(tok_dir)


def tiny_pipeline(cache_dir: str | Path | None = None) -> Path:
    """Path of the tiny SD pipeline directory, building it on first use (atomic rename, so
    concurrent first uses are safe)."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / "model_index.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "model_index.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


TINY_PROMPTS = tuple(f"a photo of a {w}" for w in ("cat", "dog", "horse", "bird", "fish"))
