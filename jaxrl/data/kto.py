"""KTO dataset preparation: unpaired preference rows -> `prompt_ids`, `completion_ids`,
`KL_completion_ids`, `label` (TRL 1.16 `KTOTrainer._prepare_dataset`).

Accepted formats (TRL's *unpaired preference* type): `{prompt, completion, label}` with a boolean
label (True: desirable), standard (strings) or conversational (message lists, rendered with the
chat template). Paired preference data (`{prompt, chosen, rejected}`, or `{chosen, rejected}`
with the shared prefix extracted as the prompt) is unpaired as TRL's `unpair_preference_dataset`
does: per block of 1000 pairs, the chosen rows (label True) then the rejected ones (label False).
The KL completions are TRL's mismatched pairs: within each consecutive block of
`kl_batch_size` rows (TRL's `per_device_train_batch_size`), row i takes row i-1's completion and
the first row the block's last one. Host-side only; `collate_unpaired` makes the rows a
batch, cutting every sequence to `max_length` as TRL's collator does.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import numpy as np

from jaxrl.data.collate import collate_sft
from jaxrl.data.formats import (
    common_prefix_length,
    example_chat_template_kwargs,
    extract_prompt,
    is_conversational,
    require_columns,
    tokenize_text_or_messages,
)

logger = logging.getLogger("jaxrl")

# `datasets.Dataset.map(batched=True)`'s default batch size, the block TRL's unpairing works in.
UNPAIR_BLOCK = 1000
_COLUMNS = ("prompt_ids", "completion_ids")


def unpair_preference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL `unpair_preference_dataset` on a list of `{[prompt,] chosen, rejected, ...}` rows:
    per block of `UNPAIR_BLOCK` pairs, each pair's chosen row (`label` True), then each pair's
    rejected row (`label` False); other columns are copied to both."""
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = rows[start : start + UNPAIR_BLOCK]
        for side, label in (("chosen", True), ("rejected", False)):
            for row in block:
                rest = {k: v for k, v in row.items() if k not in ("chosen", "rejected")}
                out.append({**rest, "completion": row[side], "label": label})
    return out


def _check_labels(labels: list[Any]) -> None:
    bad = [v for v in labels if not isinstance(v, bool) and v not in (0, 1)]
    if bad:
        raise ValueError(
            f"The KTO 'label' column must hold booleans (True: desirable completion, False: "
            f"undesirable); found {bad[0]!r}. Convert it, e.g. "
            "`dataset.map(lambda x: {'label': bool(x['label'])})`."
        )


def _tokenize(example: dict[str, Any], *, tokenizer: Any, eos_token: str) -> dict[str, Any]:
    prompt, completion = example["prompt"], example["completion"]
    if is_conversational(example):
        chat_kwargs = example_chat_template_kwargs(example)
        prompt_ids = tokenize_text_or_messages(
            tokenizer, prompt, add_generation_prompt=True, **chat_kwargs
        )["input_ids"]
        full = tokenize_text_or_messages(tokenizer, prompt + completion, **chat_kwargs)["input_ids"]
    else:
        # TRL appends EOS to standard completions so the model learns to stop.
        if not completion.endswith(eos_token):
            completion = completion + eos_token
        prompt_ids = tokenizer(prompt)["input_ids"]
        full = tokenizer(prompt + completion)["input_ids"]
    # The completion starts where the two tokenizations diverge (TRL `common_prefix_length`).
    n = common_prefix_length(prompt_ids, full)
    return {"prompt_ids": list(prompt_ids[:n]), "completion_ids": list(full[n:])}


def _kl_completions(completions: list[list[int]], kl_batch_size: int) -> list[list[int]]:
    """Each block of `kl_batch_size` completions rotated by one: `[y_n, y_1, ..., y_{n-1}]`."""
    out: list[list[int]] = []
    for start in range(0, len(completions), kl_batch_size):
        block = completions[start : start + kl_batch_size]
        out.extend([block[-1], *block[:-1]])
    return out


def prepare_unpaired_dataset(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    max_length: int | None,
    kl_batch_size: int | None,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize a KTO dataset (unpaired, or paired and then unpaired as TRL does).

    Rows: `prompt_ids`, `completion_ids` (EOS appended to standard completions lacking it),
    `label` (bool) and, with `kl_batch_size` (the loss estimates the KL term), the mismatched
    `KL_completion_ids`. As TRL 1.16: rows whose prompt alone has `max_length` tokens or more
    are dropped (a warning counts them) before the KL completions are assigned; longer rows are
    kept whole here and cut to their first `max_length` tokens when collated.
    """
    if len(dataset) == 0:
        raise ValueError("The KTO dataset is empty; pass at least one example.")
    found = require_columns(
        dataset.column_names,
        [
            ("prompt", "completion", "label"),
            ("prompt", "chosen", "rejected"),
            ("chosen", "rejected"),
        ],
        what="KTO",
        hint="KTO trains on unpaired preference data: a 'prompt', a 'completion' and a boolean "
        "'label' (True for a desirable completion) per row; paired 'chosen'/'rejected' data is "
        "unpaired automatically.",
    )
    if tokenizer.eos_token is None:
        raise ValueError("The tokenizer has no eos_token; set one before preparing KTO data.")
    if "completion" not in found:
        rows = dataset.to_list()
        if "prompt" not in found:
            rows = [{**row, **extract_prompt(row)} for row in rows]
        dataset = datasets.Dataset.from_list(unpair_preference_rows(rows))
    _check_labels(dataset["label"])
    extra = [c for c in dataset.column_names if c not in ("label",)]
    dataset = dataset.map(
        _tokenize,
        fn_kwargs={"tokenizer": tokenizer, "eos_token": tokenizer.eos_token},
        remove_columns=extra,
        num_proc=num_proc,
    )
    dataset = dataset.cast_column("label", datasets.Value("bool"))
    n_before = len(dataset)
    if max_length is not None:
        dataset = dataset.filter(
            lambda ids: len(ids) < max_length, input_columns="prompt_ids", num_proc=num_proc
        )
        dropped = n_before - len(dataset)
        if len(dataset) == 0:
            raise ValueError(
                f"All {n_before} KTO examples have a prompt of max_length={max_length} tokens or "
                "more (nothing of their completions would be trained); raise max_length."
            )
        if dropped:
            logger.warning(
                "Dropped %d of %d KTO examples whose prompt alone has max_length=%d tokens or "
                "more (TRL drops these too).",
                dropped,
                n_before,
                max_length,
            )
    if kl_batch_size is not None:
        kl = _kl_completions(dataset["completion_ids"], kl_batch_size)
        dataset = dataset.add_column(
            "KL_completion_ids", kl, feature=datasets.List(datasets.Value("int32"))
        )
    return dataset


def weight_advice(labels: list[bool], desirable_weight: float, undesirable_weight: float) -> str:
    """TRL's advice when the desirable / undesirable counts differ and neither weight is in the
    range of Eq. (8) of the KTO paper (https://huggingface.co/papers/2402.01306); "" otherwise."""
    n_d = max(sum(bool(v) for v in labels), 1)
    n_u = max(len(labels) - n_d, 1)
    if n_d == n_u:
        return ""
    d_lo = round(n_u * undesirable_weight / n_d, 2)
    d_hi = round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo = round(n_d * desirable_weight / n_u / 1.33, 2)
    u_hi = round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return ""
    return (
        "You have different amounts of desirable and undesirable examples but the weights on "
        "their losses don't seem to be in an ideal range. Based on your data, set EITHER "
        f"desirable_weight in [{d_lo}, {d_hi}] or undesirable_weight in [{u_lo}, {u_hi}] (not "
        "both)."
    )


def _lm_row(prompt: list[int], completion: list[int], max_length: int | None) -> dict:
    """One `prompt + completion` example for `collate_sft`, cut to its first `max_length`
    tokens (TRL's collator), the completion tokens trained."""
    ids = list(prompt) + list(completion)
    trained = [0] * len(prompt) + [1] * len(completion)
    if max_length is not None:
        ids, trained = ids[:max_length], trained[:max_length]
    return {"input_ids": ids, "loss_mask": trained}


def collate_unpaired(
    examples: list[dict[str, Any]],
    seq_len: int,
    pad_token_id: int,
    *,
    max_length: int | None,
    with_kl: bool,
) -> dict[str, np.ndarray]:
    """KTO batch: the `prompt + completion` rows `[B, seq_len]` (keys of `collate_sft`,
    `loss_mask` on the completion targets), with `with_kl` the same keys prefixed `KL_` for the
    `prompt + KL completion` rows, `label` `[B]` (1.0: desirable) and, when the examples carry
    them, the precomputed `ref_logps` / `ref_KL_logps` `[B]`. Each sequence is cut to its first
    `max_length` tokens, as TRL's `DataCollatorForUnpairedPreference` cuts it."""
    rows = [_lm_row(ex["prompt_ids"], ex["completion_ids"], max_length) for ex in examples]
    batch = collate_sft(rows, seq_len, pad_token_id)
    if with_kl:
        kl = [_lm_row(ex["prompt_ids"], ex["KL_completion_ids"], max_length) for ex in examples]
        batch.update({"KL_" + k: v for k, v in collate_sft(kl, seq_len, pad_token_id).items()})
    batch["label"] = np.asarray([float(bool(ex["label"])) for ex in examples], np.float32)
    for key in ("ref_logps", "ref_KL_logps"):
        if key in examples[0]:
            batch[key] = np.asarray([ex[key] for ex in examples], np.float32)
    return batch
