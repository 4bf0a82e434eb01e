"""Reward models as GRPO/RLOO reward functions: a jaxrl sequence-classification model (e.g. one
trained by `RewardTrainer`) loaded from a path and scored with one jitted forward.

`load_reward_model_func(path)` returns a `jaxrl.rewards.RewardModelFunc` (TRL's reward-function
signature) whose scorer tokenizes texts without special tokens (as TRL), right-pads them to a
power-of-two bucket (few compiled shapes) and reads the score head's first label at the last
real token. This file holds no training code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import models
from jaxrl.generation import bucket_length
from jaxrl.rewards import RewardModelFunc


def load_reward_model_func(
    path: str,
    *,
    tokenizer: Any = None,
    batch_size: int = 64,
    dtype: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> RewardModelFunc:
    """A reward function scoring `prompt + completion` texts with the reward model at `path`.

    `tokenizer`: the reward model's tokenizer (TRL's `reward_processing_classes` entry); None
    loads it from `path`. Its name in the metrics is the last path component, as TRL.
    """
    model = models.from_pretrained(path, task="sequence_classification", dtype=dtype)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id  # TRL sets the reward model's config.pad_token_id to it
    graphdef, params = nnx.split(model)

    @jax.jit
    def score(params, ids_BT, mask_BT):
        model = nnx.merge(graphdef, params)
        return model(ids_BT, mask_BT, pad_token_id=pad_id)[:, 0].astype(np.float32)

    def score_texts(texts: list[str]) -> list[float]:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for start in range(0, len(ids), batch_size):
            rows = ids[start : start + batch_size]
            width = bucket_length(max(len(r) for r in rows), None)
            ids_BT = np.full((batch_size, width), tokenizer.pad_token_id, np.int32)
            mask_BT = np.zeros((batch_size, width), np.int32)
            mask_BT[len(rows) :, 0] = 1  # filler rows: one token, scores dropped
            for i, r in enumerate(rows):
                ids_BT[i, : len(r)] = r
                mask_BT[i, : len(r)] = 1
            out.extend(np.asarray(score(params, ids_BT, mask_BT))[: len(rows)].tolist())
        return out

    return RewardModelFunc(
        score_texts,
        name=os.path.basename(os.path.normpath(str(path))),
        tokenizer=tokenizer,
        chat_template_kwargs=chat_template_kwargs,
    )
