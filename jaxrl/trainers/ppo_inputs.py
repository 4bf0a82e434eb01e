"""PPO's host-side batches, as TRL v0.7.2 builds them: the prompt dataloader (shuffled full
batches, unused columns dropped), the checks `step()` runs on its `(queries, responses, scores)`
lists, the padded `input_ids` / `attention_mask` of query + response, and the response mask of
`batched_forward_pass`.

NumPy only; nothing here touches parameters or runs traced code (`jaxrl.algos.ppo` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data.batching import BatchIterator

# Columns TRL keeps with remove_unused_columns: the value-head model's forward arguments
# (input_ids, past_key_values, attention_mask) plus its logging columns.
SIGNATURE_COLUMNS = ("input_ids", "past_key_values", "attention_mask", "label", "query", "response")


def as_1d_ints(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)
    if arr.ndim != 1:
        raise ValueError(
            f"Each element of {name} must be a 1-D token tensor, got shape {arr.shape}."
        )
    return arr.astype(np.int64)


def dict_of_lists(rows: list[dict]) -> dict[str, list]:
    """TRL's examples' `collator`: the batch's rows as a dict of column lists."""
    return {k: [r[k] for r in rows] for k in rows[0]}


def prompt_batches(
    dataset: Any, batch_size: int, seed: int, collate_fn: Callable | None = None
) -> BatchIterator:
    """Shuffled batches of `batch_size` rows per process (last partial batch dropped), a new
    order each epoch, collated by `collate_fn` (default `dict_of_lists`)."""
    return BatchIterator(
        dataset,
        global_batch_size=batch_size * jax.process_count(),
        seed=seed,
        collate_fn=collate_fn or dict_of_lists,
        shuffle=True,
        drop_last=True,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


class EpochLoader:
    """TRL's dataloader contract: `for batch in loader` is one shuffled epoch of full batches
    (`drop_last`), a new order each epoch; `len(loader)` is the batches per epoch."""

    def __init__(self, iterator: Any):
        self._it = iterator

    def __len__(self) -> int:
        return self._it.steps_per_epoch

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self._it)


def check_step_inputs(batch_size, queries, responses, scores, masks=None):
    """TRL's `_step_safety_checker`: lists of `batch_size` 1-D token arrays and one-value
    scores (and response masks as long as their responses); returns them as NumPy arrays."""
    for name, seq in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(seq, list):
            raise ValueError(f"{name} must be a list of tensors - got {type(seq)}")
        if batch_size is not None and len(seq) != batch_size:
            raise ValueError(
                f"Batch size ({batch_size}) does not match number of examples - but got "
                f"{len(seq)} for: {name}"
            )
    queries = [as_1d_ints(q, "queries") for q in queries]
    responses = [as_1d_ints(r, "responses") for r in responses]
    flat_scores = []
    for s in scores:
        arr = np.asarray(s.detach().cpu() if hasattr(s, "detach") else s, np.float32)
        if arr.ndim > 1:
            raise ValueError(f"Scores must be 1-dimensional - got {arr.ndim} for {s}")
        if arr.size != 1:
            raise ValueError(f"Each score must hold one value, got {arr.size} for {s}")
        flat_scores.append(arr.reshape(()))
    if masks is not None:
        if not isinstance(masks, list) or len(masks) != len(responses):
            raise ValueError("response_masks must be a list with one mask per response.")
        masks = [as_1d_ints(m, "response_masks") for m in masks]
        for m, r in zip(masks, responses, strict=True):
            if len(m) != len(r):
                raise ValueError(
                    f"A response mask has length {len(m)} but its response has {len(r)}."
                )
    return queries, responses, np.stack(flat_scores), masks


def model_inputs(
    queries: Sequence,
    responses: Sequence,
    pad_token_id: int,
    padding_side: str,
    pad_to_multiple_of: int | None,
) -> dict[str, np.ndarray]:
    """`input_ids` (query + response, padded with `pad_token_id` on `padding_side`) and
    `attention_mask`, as TRL's `DataCollatorForLanguageModeling` makes them."""
    seqs = [
        np.concatenate([np.asarray(q), np.asarray(r)])
        for q, r in zip(queries, responses, strict=True)
    ]
    length = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    ids = np.full((len(seqs), length), pad_token_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    left = padding_side == "left"
    for i, s in enumerate(seqs):
        sl = slice(length - len(s), length) if left else slice(0, len(s))
        ids[i, sl] = s
        mask[i, sl] = 1
    return {"input_ids": ids, "attention_mask": mask}


def response_mask(queries, responses, attention_mask_BL, response_masks) -> np.ndarray:
    """TRL's loss mask `[B, L - 1]`: position t is 1 iff token t + 1 is a response token
    (and, with `response_masks`, that token's mask is 1)."""
    B, L = attention_mask_BL.shape
    masks = np.zeros((B, L), np.float32)
    masks[:, :-1] = attention_mask_BL[:, 1:]
    for j in range(B):
        start = _response_start(len(queries[j]), attention_mask_BL[j])
        end = start + len(responses[j])
        masks[j, :start] = 0
        masks[j, end:] = 0
        if response_masks is not None:
            masks[j, start:end] *= response_masks[j]
    return masks[:, :-1]


def _response_start(query_len: int, attention_mask_L: np.ndarray) -> int:
    """Position (in TRL's shifted `[L - 1]` layout) whose target is the first response token."""
    start = query_len - 1
    if attention_mask_L[0] == 0:  # left padding
        start += int(np.argmax(attention_mask_L))
    return start


def response_values(queries, responses, attention_mask_BL, values) -> np.ndarray:
    """`[B, L - 1]` float32: each response's per-token `values` (one per response token, e.g.
    the sampler's log-probs) at the positions of `response_mask`, 0 elsewhere."""
    B, L = attention_mask_BL.shape
    out = np.zeros((B, L - 1), np.float32)
    for j in range(B):
        row = np.asarray(values[j], np.float32).reshape(-1)
        if row.shape[0] != len(responses[j]):
            raise ValueError(
                f"Response {j} has {len(responses[j])} tokens but {row.shape[0]} values."
            )
        start = _response_start(len(queries[j]), attention_mask_BL[j])
        out[j, start : start + row.shape[0]] = row
    return out


def batch_queries(batch: dict, tokenizer: Any) -> tuple[list[np.ndarray], list[str]]:
    """`train()`'s prompts of a dataset batch: token ids (`input_ids`, or the tokenized
    `query` / `prompt` text) and their texts (the column, or the decoded ids)."""
    text_col = next((c for c in ("query", "prompt") if c in batch), None)
    if "input_ids" in batch:
        queries = [np.asarray(q, np.int64) for q in batch["input_ids"]]
        texts = (
            batch[text_col]
            if text_col
            else tokenizer.batch_decode(queries, skip_special_tokens=True)
        )
        return queries, list(texts)
    if text_col is None:
        raise ValueError(
            f"The dataset needs a `query` or `prompt` column or `input_ids`; got {list(batch)}."
        )
    texts = list(batch[text_col])
    queries = [np.asarray(tokenizer(t)["input_ids"], np.int64) for t in texts]
    return queries, texts


def check_rollout_lengths(queries: list[np.ndarray], response_length: int, positions: int | None):
    """`train()`'s rollouts must fit the policy's positions (`max_position_embeddings`): the
    longest query plus `response_length` new tokens (the same rule as GRPO/RLOO's prompts)."""
    if not positions or not queries:
        return
    row = max(range(len(queries)), key=lambda i: len(queries[i]))
    longest = len(queries[row])
    if longest >= positions:
        raise ConfigError(
            f"Query {row} of this batch is {longest} tokens long, but the model has only "
            f"{positions} positions (max_position_embeddings), leaving no room for a response. "
            "Drop or shorten the long prompts, or use a model with a longer context."
        )
    if longest + response_length > positions:
        raise ConfigError(
            f"response_length={response_length} plus the longest query of this batch ({longest} "
            f"tokens, row {row}) is {longest + response_length} tokens, beyond the model's "
            f"{positions} positions (max_position_embeddings). Lower response_length to at most "
            f"{positions - longest}, or shorten the long prompts."
        )
