"""PPO's sampling and scoring on the host: TRL v0.7.2's `generate` keyword arguments mapped onto
jaxrl's `GenerationConfig` (and `train()`'s rollout settings), TRL's `remove_padding` of a
response, the sampler of a LoRA policy's reference (every adapter branch skipped), and
`train()`'s reward (a callable on texts, or a reward model directory scored with one jitted
forward).

The sampler itself is `jaxrl.generation`'s; no training math here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import lora
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.models.hf import from_pretrained

# transformers `generate` keyword arguments that map onto jaxrl's GenerationConfig.
GENERATION_KWARGS = (
    "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "stop_strings",
)  # fmt: skip


def generation_config(
    generation_kwargs: dict[str, Any], response_length: int, tokenizer: Any
) -> GenerationConfig:
    """A `GenerationConfig` from transformers `generate` keyword arguments.

    Defaults are transformers' (greedy, top_k=50) with the tokenizer's EOS/pad ids and
    `max_new_tokens=response_length`. `min_length` <= 0 (TRL's examples pass -1) and
    `use_cache` are inactive; a positive `min_length`, `max_length`, beams or several return
    sequences raise (use `min_new_tokens` / `max_new_tokens`). `stop_strings` are matched with
    the trainer's tokenizer; transformers' `tokenizer=` (which `generate` needs with them) is
    accepted when it has the same vocabulary."""
    kw = dict(generation_kwargs)
    given = kw.pop("tokenizer", None)
    if given is not None and given is not tokenizer and given.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "generate(tokenizer=...) has another vocabulary than the trainer's tokenizer; "
            "stop_strings are matched with the trainer's, so pass that one (or none)."
        )
    min_length = kw.pop("min_length", None)
    if min_length is not None and min_length > 0:
        raise ValueError(
            f"min_length={min_length} counts the (left-padded) prompt tokens; pass "
            "min_new_tokens instead."
        )
    kw.pop("use_cache", None)  # the sampler always decodes with its KV cache
    if "max_length" in kw:
        raise ValueError("max_length is not supported; pass max_new_tokens (or length_sampler).")
    for name in ("num_beams", "num_return_sequences"):
        if kw.pop(name, 1) != 1:
            raise ValueError(f"{name} != 1 is not supported by jaxrl's sampler.")
    unknown = sorted(set(kw) - set(GENERATION_KWARGS))
    if unknown:
        raise ValueError(
            f"Unsupported generation kwargs {unknown}; supported: {GENERATION_KWARGS}, "
            "min_length (<= 0), use_cache, tokenizer, num_beams=1, num_return_sequences=1."
        )
    if "top_k" in kw:  # TRL's examples pass top_k=0.0
        if float(kw["top_k"]) != int(kw["top_k"]):
            raise ValueError(f"top_k must be a whole number, got {kw['top_k']}.")
        kw["top_k"] = int(kw["top_k"])
    kw.setdefault("max_new_tokens", response_length)
    kw.setdefault("eos_token_id", tokenizer.eos_token_id)
    kw.setdefault("pad_token_id", tokenizer.pad_token_id)
    return GenerationConfig(**kw)


def rollout_generation_config(config: Any, tokenizer: Any) -> GenerationConfig:
    """`train()`'s sampling: `config`'s response lengths, temperature, top-k and top-p (TRL's
    PPO examples sample), ending at the tokenizer's EOS."""
    c = config
    return GenerationConfig(
        max_new_tokens=c.response_length,
        min_new_tokens=c.min_response_length,
        do_sample=True,
        temperature=c.temperature,
        top_k=c.top_k,
        top_p=c.top_p,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def remove_padding(
    query: np.ndarray, completion: np.ndarray, return_prompt: bool, eos_token_id: int
) -> np.ndarray:
    """TRL's `remove_padding`: the response (after the query if `return_prompt`), cut after
    the tokenizer's first EOS anywhere in it."""
    out = np.concatenate([query, completion]) if return_prompt else completion
    eos = np.flatnonzero(out == eos_token_id)
    return out[: eos[0] + 1] if eos.size else out


class AdapterOffSampler(Sampler):
    """A sampler whose traced model skips every LoRA branch: the reference of a LoRA policy
    (the context variable is read when the model is traced, so it wraps the traced functions)."""

    _trace_context = staticmethod(lora.disable_adapter)


def build_reward(reward: Any, tokenizer: Any) -> Callable | None:
    """`train()`'s reward: a callable `(prompts, completions) -> scores` as is, or the path of a
    reward model (`reward_model_scorer`)."""
    if reward is None or callable(reward):
        return reward
    if isinstance(reward, str | os.PathLike):
        return reward_model_scorer(str(reward), tokenizer)
    raise ValueError(
        "reward must be a callable (prompts, completions) -> scores or the path of a reward "
        f"model, got {type(reward).__name__}."
    )


def reward_model_scorer(path: str, tokenizer: Any) -> Callable:
    """Score `prompt + completion + eos` texts with a jitted forward of the reward model at
    `path` (its own tokenizer when saved there, else `tokenizer`), right-padded to a multiple
    of 16."""
    from transformers import AutoTokenizer

    # A causal LM would score with a random new head: refused (`require_trained_head`).
    rm = from_pretrained(path, task="sequence_classification", require_trained_head=True)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tok = tokenizer
    graphdef, params = nnx.split(rm)
    forward = jax.jit(lambda p, ids, m: nnx.merge(graphdef, p)(ids, attention_mask=m)[:, 0])
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def score(prompts: list[str], completions: list[str]) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        eos = tok.eos_token or ""
        ids = [tok(t if t.endswith(eos) else t + eos)["input_ids"] for t in texts]
        width = -(-max(len(x) for x in ids) // 16) * 16
        ids_BT = np.full((len(ids), width), pad, np.int32)
        mask_BT = np.zeros((len(ids), width), np.int32)
        for i, x in enumerate(ids):
            ids_BT[i, : len(x)], mask_BT[i, : len(x)] = x, 1
        return np.asarray(forward(params, ids_BT, mask_BT), np.float32).tolist()

    return score
