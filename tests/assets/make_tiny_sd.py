"""The recipe of the package's tiny SD pipeline (`jaxrl/assets/tiny_sd/`, made by this at v2).

    PYTHONPATH=$PWD python tests/assets/make_tiny_sd.py [DIR]

builds the pipeline from the configs in `jaxrl.models.diffusion.tiny` with diffusers and
transformers (PyTorch, torch seeds 0/1/2 for UNet/VAE/text encoder), saves it with
`save_pretrained` (safetensors) into DIR (default: a scratch directory) and prints the path.
`tests/models/diffusion/test_tiny_sd.py` builds it again and checks that the shipped weights are
what it makes. Copy the result over `jaxrl/assets/tiny_sd/` only for a deliberate new version:
the DDPO numbers in BENCHMARKS.md and the CLI test's rising reward were measured on these weights.
Needs the `test` extra (torch, diffusers' PyTorch models).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from jaxrl.models.diffusion import tiny


def _tokenizer_files(directory: Path) -> int:
    """vocab.json (the words, then single characters with and without `</w>`) and an empty
    merges.txt; returns the vocabulary size."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for w in tiny.WORDS:
        vocab[f"{w}</w>"] = len(vocab)
    for ch in sorted(set("".join(tiny.WORDS))):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(f"{ch}</w>", len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return len(vocab)


def build(directory: Path) -> Path:
    """Write the tiny pipeline into the new directory `directory`."""
    import diffusers
    import torch
    import transformers

    directory = Path(directory)
    tok_dir = directory / "_tok"
    tok_dir.mkdir(parents=True)
    vocab_size = _tokenizer_files(tok_dir)
    tokenizer = transformers.CLIPTokenizer(
        str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"), model_max_length=20
    )
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**tiny.UNET)
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKL(**tiny.VAE)
    torch.manual_seed(2)
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(**tiny.CLIP_TEXT, vocab_size=vocab_size)
    )
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=diffusers.DDIMScheduler(**tiny.SCHEDULER),
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
    return directory


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "tiny_sd"
    print(build(out))
