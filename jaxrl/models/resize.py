"""Resizing a model's token embeddings, as transformers' `resize_token_embeddings` does (what
TRL's `clone_chat_template` calls after adding a source tokenizer's tokens).

The input table (and an untied LM head) get `new_num_tokens` rows, rounded up to
`pad_to_multiple_of`: the first rows are kept, a smaller size drops the last ones, and added rows
are drawn as transformers' default `mean_resizing=True` draws them: from a normal distribution
with the old rows' mean and 1e-9 times their covariance (so each new token starts next to the
average token), or the mean itself where that covariance is not positive definite. The model
config's `vocab_size` (and its HF config's) follows. An untied head's added rows are drawn from
its own rows' distribution, as transformers does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl import parallel
from jaxrl.models import hf
from jaxrl.models.layers import Embed

# transformers' scale of the old rows' covariance for the added rows' distribution.
COVARIANCE_SCALE = 1e-9


def resized_vocab_size(new_num_tokens: int, pad_to_multiple_of: int | None) -> int:
    """`new_num_tokens` rounded up to a multiple of `pad_to_multiple_of` (transformers)."""
    if new_num_tokens <= 0:
        raise ValueError(f"new_num_tokens must be positive, got {new_num_tokens}.")
    if pad_to_multiple_of is None:
        return new_num_tokens
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 0:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}.")
    return -(-new_num_tokens // pad_to_multiple_of) * pad_to_multiple_of


def mean_resized_rows(old_VD: np.ndarray, added: int, rng: np.random.Generator) -> np.ndarray:
    """`added` new rows for the table `old_VD` (float32 statistics, in its dtype), drawn as
    transformers' `_init_added_embeddings_weights_with_mean` draws them."""
    old = np.asarray(old_VD, np.float32)
    mean = old.mean(axis=0)
    centered = old - mean
    covariance = centered.T.astype(np.float64) @ centered / old.shape[0]
    try:  # transformers samples only where eps * covariance is positive definite
        chol = np.linalg.cholesky(COVARIANCE_SCALE * covariance)
    except np.linalg.LinAlgError:
        chol = None
    if chol is None:
        rows = np.repeat(mean[None], added, axis=0)
    else:
        rows = mean + rng.standard_normal((added, old.shape[1])) @ chol.T
    return rows.astype(old_VD.dtype)


def _resized(variable: nnx.Variable, size: int, rows_axis: int, rng, config) -> jax.Array:
    """`variable`'s array with `size` rows along `rows_axis`, placed as the model's params."""
    host = np.asarray(jax.device_get(variable.get_value()))
    table = np.moveaxis(host, rows_axis, 0)
    old = table.shape[0]
    if size <= old:
        new = table[:size]
    else:
        new = np.concatenate([table, mean_resized_rows(table, size - old, rng)])
    new = np.ascontiguousarray(np.moveaxis(new, 0, rows_axis))
    return hf.place(new, parallel.variable_axes(variable), config)


def token_tables(model: nnx.Module) -> list[tuple[nnx.Variable, int]]:
    """The model's vocabulary-sized parameters and their row axis: each token embedding table
    (rows first) and an untied LM head's kernel ([D, V]: rows last)."""
    tables = []
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Embed) and module.token_table:
            tables.append((module.embedding, 0))
        elif path and path[-1] == "lm_head" and isinstance(module, nnx.Module):
            tables.append((module.kernel, -1))
    return tables


def resize_token_embeddings(
    model: nnx.Module,
    new_num_tokens: int,
    *,
    pad_to_multiple_of: int | None = None,
    seed: int = 0,
) -> int:
    """Resize `model`'s token tables in place to `new_num_tokens` rows rounded up to
    `pad_to_multiple_of` (module docstring); returns the new vocabulary size. The new arrays are
    placed as the model's params are (its config's mesh and sharding rules). Models with LoRA
    adapters or a quantized base are refused: resize before adding them."""
    config = model.config
    tables = token_tables(model)
    if not tables:
        raise ValueError(f"{type(model).__name__} has no token embedding table to resize.")
    for variable, _ in tables:
        if not isinstance(variable.get_value(), jax.Array) or type(variable) is not nnx.Param:
            raise ValueError(
                "Resize the token embeddings before adding LoRA adapters or quantizing the "
                "base model."
            )
    size = resized_vocab_size(int(new_num_tokens), pad_to_multiple_of)
    rng = np.random.default_rng(seed)
    for variable, rows_axis in tables:
        value = variable.get_value()
        if value.shape[rows_axis] != config.vocab_size:
            raise ValueError(
                f"A token table has {value.shape[rows_axis]} rows but the config's vocab_size is "
                f"{config.vocab_size}."
            )
        variable.set_value(_resized(variable, size, rows_axis, rng, config))
    hf_config = config.hf_config
    if hf_config is not None:
        hf_config.get_text_config().vocab_size = size
    new_config = dataclasses.replace(config, vocab_size=size)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and getattr(module, "config", None) is config:
            module.config = new_config
    return size


def clone_chat_template(
    model: nnx.Module,
    tokenizer: Any,
    source_tokenizer_path: str,
    resize_to_multiple_of: int | None = 64,
    *,
    seed: int = 0,
) -> tuple[nnx.Module, Any, list[int]]:
    """TRL's `clone_chat_template`: give `tokenizer` the chat template of the tokenizer at
    `source_tokenizer_path` (a directory, or a hub id where the hub is reachable), add that
    tokenizer's added tokens missing from `tokenizer`, make its EOS the EOS (of the tokenizer and
    of the model's HF config), and resize the model's token tables to the new vocabulary rounded
    up to `resize_to_multiple_of`, filling the tokenizer with `<extra_id_N>` tokens up to that
    size. Returns (model, tokenizer, the added tokens' ids), as TRL's; both changed in place."""
    from transformers import AddedToken, AutoTokenizer

    source = AutoTokenizer.from_pretrained(source_tokenizer_path)
    template = source.get_chat_template()
    tokenizer.chat_template = template
    vocab = tokenizer.get_vocab()
    added = [t for t in source.added_tokens_decoder.values() if t.content not in vocab]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    hf_config = model.config.hf_config
    if hf_config is not None:
        hf_config.get_text_config().eos_token_id = tokenizer.eos_token_id
    size = resize_token_embeddings(
        model,
        len(tokenizer.get_vocab()),
        pad_to_multiple_of=resize_to_multiple_of,
        seed=seed,
    )
    index = 0
    while len(tokenizer.get_vocab()) < size:
        dummy = AddedToken(f"<extra_id_{index}>")
        if tokenizer.add_tokens(dummy) == 1:
            added.append(dummy)
        index += 1
    if len(tokenizer.get_vocab()) != size:
        raise ValueError(
            f"After cloning the chat template the tokenizer has {len(tokenizer.get_vocab())} "
            f"tokens but the model's embeddings have {size} rows (a source or target tokenizer "
            "whose vocabulary exceeds the resized table)."
        )
    return model, tokenizer, tokenizer.convert_tokens_to_ids([t.content for t in added])
