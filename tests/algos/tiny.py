"""Tiny models for the algos tests and numpy references of what they compute.

A 2-layer Qwen2-shaped causal LM (one per seed: a policy and a reference) and its
sequence-classification twin, built once per process; `np_logits` gives a model's float64 full
logits (one jitted call per shape), against which the chunked, span-restricted and
prefix-shared paths of `jaxrl.algos` are checked.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import transformers
from flax import nnx

from jaxrl.models import from_config
from tests.trainers import trainer_utils

VOCAB = 32
PAD = 0


def tiny_config() -> transformers.Qwen2Config:
    """The trainer tests' tiny Qwen2 (`tests/trainers/trainer_utils.py`) with a wider init, so
    log-probs, argmaxes and entropies differ from token to token."""
    config = trainer_utils.tiny_config(vocab_size=VOCAB)
    config.initializer_range = 0.2
    return config


@functools.cache
def lm(seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """`(graphdef, params)` of the tiny causal LM initialised from `seed`."""
    return nnx.split(from_config(tiny_config(), seed=seed))


@functools.cache
def scorer(seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """`(graphdef, params)` of the tiny sequence-classification model (one label)."""
    model = from_config(tiny_config(), seed=seed, task="sequence_classification", num_labels=1)
    return nnx.split(model)


def apply_model(graphdef: nnx.GraphDef):
    """A trainer's `apply_model(params, state)` for a model held split (no LoRA, no state)."""
    return lambda params, state: nnx.merge(graphdef, params)


@functools.partial(jax.jit, static_argnums=0)
def _call(graphdef, params, ids_BT):
    return nnx.merge(graphdef, params)(ids_BT)


def np_logits(graphdef, params, ids_BT) -> np.ndarray:
    """float64 full logits `[B, T, V]` of a causal LM on `ids_BT` (causal, no mask: right
    padding does not reach the real tokens before it)."""
    return np.asarray(_call(graphdef, params, np.asarray(ids_BT)), np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def np_scores(graphdef, params, sequences) -> np.ndarray:
    """float64 scores `[N]` of each of `sequences` scored alone (unpadded, at its last token)."""
    return np.asarray(
        [float(np.asarray(_call(graphdef, params, np.asarray([s])))[0, 0]) for s in sequences]
    )


def greedy(graphdef, params, prompt: list[int], n: int, width: int = 16) -> list[int]:
    """The `n` tokens the model picks greedily after `prompt` (so that a completion of them has
    argmax hits: a random completion has none)."""
    tokens = list(prompt)
    for _ in range(n):
        ids = np.full((1, width), PAD)
        ids[0, : len(tokens)] = tokens
        tokens.append(int(np_logits(graphdef, params, ids)[0, len(tokens) - 1].argmax()))
    return tokens[len(prompt) :]
