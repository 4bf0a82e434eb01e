"""Shared helpers for the generation tests: HF reference models (from tests/models) and prompts."""

from __future__ import annotations

import numpy as np
import torch

from tests.models.conftest import VOCAB, hf_causal  # noqa: F401  (re-exported fixture)

PAD = 0


def ragged_prompts(seed: int = 0, lengths: tuple[int, ...] = (7, 3, 11, 1)) -> list[list[int]]:
    """Prompts of different lengths with no special ids (0-2) inside."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def hf_generate(
    model, prompts: list[list[int]], pad: int = PAD, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """transformers `generate` on prompts left-padded with `pad`: new tokens [B, N] and their
    raw logits [B, N', V] (tokens right-padded with `pad` to `max_new_tokens` when it stops
    early; N' <= N steps)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    new = out.sequences[:, width:].numpy()
    n = kwargs["max_new_tokens"]
    new = np.pad(new, ((0, 0), (0, n - new.shape[1])), constant_values=pad)
    logits = torch.stack(out.logits, dim=1).float().numpy()
    return new, logits
