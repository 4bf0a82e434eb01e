"""Reward-model dataset preparation: preference pairs -> full `chosen_input_ids` and
`rejected_input_ids` sequences (prompt included), plus `margin` when the data has one.

Accepted formats (TRL `RewardTrainer`): implicit `{chosen, rejected}`, explicit
`{prompt, chosen, rejected}` (prompt prepended to both), conversational variants of both, and
pre-tokenized pairs `{input_ids_chosen, input_ids_rejected}` (optionally with
`attention_mask_chosen/attention_mask_rejected`; padded positions are removed) or
`{chosen_ids, rejected_ids}`. Conversational pairs render with their `tools` /
`chat_template_kwargs` columns. Host-side only; the output feeds `collate.collate_reward`.
"""

import warnings
from typing import Any

import datasets

from jaxrl.data.formats import (
    example_chat_template_kwargs,
    is_conversational,
    require_columns,
    token_features,
    tokenize_text_or_messages,
)

_PRETOKENIZED = {
    ("input_ids_chosen", "input_ids_rejected"): (
        "attention_mask_chosen",
        "attention_mask_rejected",
    ),
    ("chosen_ids", "rejected_ids"): None,
    ("chosen_input_ids", "rejected_input_ids"): None,
}


def _tokenize_pair(example: dict[str, Any], *, tokenizer: Any, eos_token: str) -> dict[str, list]:
    chosen, rejected = example["chosen"], example["rejected"]
    chat_kwargs = example_chat_template_kwargs(example)  # read for every example, as TRL
    if not chosen or not rejected:
        return {"chosen_input_ids": [], "rejected_input_ids": []}  # dropped by the caller
    if "prompt" in example:
        chosen, rejected = example["prompt"] + chosen, example["prompt"] + rejected
    if is_conversational({"chosen": chosen}):
        # Per-example `tools` / `chat_template_kwargs` go to the chat template, as in TRL.
        return {
            "chosen_input_ids": tokenize_text_or_messages(tokenizer, chosen, **chat_kwargs)[
                "input_ids"
            ],
            "rejected_input_ids": tokenize_text_or_messages(tokenizer, rejected, **chat_kwargs)[
                "input_ids"
            ],
        }
    # TRL appends EOS so the score is read on the same token for every sequence.
    chosen = chosen if chosen.endswith(eos_token) else chosen + eos_token
    rejected = rejected if rejected.endswith(eos_token) else rejected + eos_token
    return {
        "chosen_input_ids": tokenizer(chosen)["input_ids"],
        "rejected_input_ids": tokenizer(rejected)["input_ids"],
    }


def _unpad_pair(example: dict[str, Any], *, ids_cols: tuple, mask_cols: tuple | None) -> dict:
    out = {}
    for i, name in enumerate(("chosen_input_ids", "rejected_input_ids")):
        ids = list(example[ids_cols[i]])
        if mask_cols is not None and mask_cols[i] in example:
            ids = [t for t, m in zip(ids, example[mask_cols[i]], strict=True) if m]
        out[name] = ids
    return out


def prepare_reward_dataset(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize a reward-modelling dataset with TRL `RewardTrainer` semantics.

    Pairs where either sequence is longer than `max_length` are filtered out, not truncated (as
    TRL does: a truncated sequence would be scored on a token that is not its end); a warning
    gives the count and an error is raised if no pair is left. Pairs with an empty side are
    dropped the same way. EOS is appended to standard text lacking it. Output columns:
    `chosen_input_ids`, `rejected_input_ids` and, if present in the input, `margin`.
    """
    if len(dataset) == 0:
        raise ValueError("The reward dataset is empty; pass at least one example.")
    columns = dataset.column_names
    n_before = len(dataset)
    pretokenized = next((k for k in _PRETOKENIZED if all(c in columns for c in k)), None)
    keep = ["margin"] if "margin" in columns else []
    features = token_features(
        ["chosen_input_ids", "rejected_input_ids"], {k: dataset.features[k] for k in keep}
    )
    if pretokenized is not None:
        dataset = dataset.map(
            _unpad_pair,
            fn_kwargs={"ids_cols": pretokenized, "mask_cols": _PRETOKENIZED[pretokenized]},
            remove_columns=[c for c in columns if c not in keep],
            features=features,
            num_proc=num_proc,
        )
    else:
        require_columns(
            columns,
            [("prompt", "chosen", "rejected"), ("chosen", "rejected"), *_PRETOKENIZED],
            what="Reward",
            hint="Rename your columns to 'chosen'/'rejected' (and optionally 'prompt').",
        )
        if tokenizer.eos_token is None:
            raise ValueError(
                "The tokenizer has no eos_token; set one before preparing reward data."
            )
        dataset = dataset.map(
            _tokenize_pair,
            fn_kwargs={"tokenizer": tokenizer, "eos_token": tokenizer.eos_token},
            remove_columns=[c for c in columns if c not in keep],
            features=features,
            num_proc=num_proc,
        )
    dataset = dataset.filter(
        lambda ex: (
            0 < len(ex["chosen_input_ids"])
            and 0 < len(ex["rejected_input_ids"])
            and (
                max_length is None
                or (
                    len(ex["chosen_input_ids"]) <= max_length
                    and len(ex["rejected_input_ids"]) <= max_length
                )
            )
        ),
        num_proc=num_proc,
    )
    if len(dataset) == 0:
        raise ValueError(
            f"No reward pair is left after dropping empty pairs and pairs longer than "
            f"max_length={max_length}; raise max_length or check the data."
        )
    if len(dataset) < n_before:
        warnings.warn(
            f"Dropped {n_before - len(dataset)} of {n_before} reward pairs that were empty or longer "
            f"than max_length={max_length} tokens.",
            stacklevel=2,
        )
    return dataset
