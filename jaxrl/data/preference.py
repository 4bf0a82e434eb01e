"""DPO dataset preparation: preference pairs -> `prompt_input_ids`, `chosen_input_ids`,
`rejected_input_ids`.

Accepted formats (TRL `DPOTrainer`): explicit `{prompt, chosen, rejected}` and implicit
`{chosen, rejected}` (shared prefix extracted as the prompt, TRL `maybe_extract_prompt`), each
standard (strings) or conversational (message lists, rendered with the chat template). Host-side
only; the output feeds `collate.collate_preference`.
"""

import warnings
from typing import Any, Literal

import datasets

from jaxrl.data.formats import (
    common_prefix_length,
    extract_prompt,
    is_conversational,
    require_columns,
    token_features,
    tokenize_text_or_messages,
)

_EMPTY = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}


def _maybe_extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """TRL `maybe_extract_prompt`: keep an explicit prompt unless its format (conversational or
    not) differs from the completions', which means the prompt is still inside them."""
    if "prompt" in example and is_conversational(
        {"prompt": example["prompt"]}
    ) == is_conversational({"chosen": example["chosen"]}):
        return example
    return extract_prompt(example)


def _is_empty(value: Any) -> bool:
    return value is None or len(value) == 0


def _truncate(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    *,
    max_prompt_length: int | None,
    max_completion_length: int | None,
    max_length: int | None,
    truncation_mode: str,
) -> tuple[list[int], list[int], list[int]]:
    if max_completion_length is not None:
        chosen, rejected = chosen[:max_completion_length], rejected[:max_completion_length]
    if max_length is None:
        return prompt, chosen, rejected
    longer = max(len(chosen), len(rejected))
    if len(prompt) + longer > max_length and max_prompt_length is not None:
        prompt = (
            prompt[:max_prompt_length]
            if truncation_mode == "keep_start"
            else prompt[-max_prompt_length:]
        )
    if len(prompt) + longer > max_length:
        # TRL (<=0.11) cut completions to `max_length - max_prompt_length`, leaving the prompt room.
        keep = max_length - (max_prompt_length if max_prompt_length is not None else len(prompt))
        chosen, rejected = chosen[:keep], rejected[:keep]
    return prompt, chosen, rejected


def _tokenize_pair(
    example: dict[str, Any], *, tokenizer: Any, eos_token: str, truncation: dict
) -> dict[str, list[int]]:
    example = _maybe_extract_prompt(example)
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if _is_empty(chosen) or _is_empty(rejected):
        return dict(_EMPTY)
    if is_conversational(example):
        prompt_ids = tokenize_text_or_messages(tokenizer, prompt, add_generation_prompt=True)[
            "input_ids"
        ]
        chosen_full = tokenize_text_or_messages(tokenizer, prompt + chosen)["input_ids"]
        rejected_full = tokenize_text_or_messages(tokenizer, prompt + rejected)["input_ids"]
    else:
        # TRL appends EOS to standard completions so the model learns to stop.
        chosen = chosen if chosen.endswith(eos_token) else chosen + eos_token
        rejected = rejected if rejected.endswith(eos_token) else rejected + eos_token
        prompt_ids = tokenizer(prompt)["input_ids"]
        chosen_full = tokenizer(prompt + chosen)["input_ids"]
        rejected_full = tokenizer(prompt + rejected)["input_ids"]
    # Completions start where the tokenizations diverge (TRL `common_prefix_length`).
    n = min(
        common_prefix_length(prompt_ids, chosen_full),
        common_prefix_length(prompt_ids, rejected_full),
    )
    p, c, r = _truncate(prompt_ids[:n], chosen_full[n:], rejected_full[n:], **truncation)
    if not c or not r:
        return dict(_EMPTY)
    return {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}


def prepare_preference_dataset(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    max_prompt_length: int | None = 512,
    max_completion_length: int | None = None,
    max_length: int | None = 1024,
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_end",
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize a preference dataset for DPO.

    Truncation follows TRL's original DPO semantics, in this order:
      1. completions are cut to their first `max_completion_length` tokens;
      2. if `prompt + longer completion` exceeds `max_length`, the prompt is cut to
         `max_prompt_length` tokens, keeping its end (`truncation_mode="keep_end"`, default) or its
         start (`"keep_start"`);
      3. if it still exceeds `max_length`, completions are cut to `max_length - max_prompt_length`
         tokens (`max_length - len(prompt)` when `max_prompt_length` is None).
    `max_length=None` disables steps 2-3. EOS is appended to standard completions lacking it.
    Pairs whose chosen or rejected completion is empty (or truncated to nothing) are dropped with
    a warning; an error is raised if nothing is left.
    """
    if len(dataset) == 0:
        raise ValueError("The preference dataset is empty; pass at least one example.")
    require_columns(
        dataset.column_names,
        [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
        what="Preference",
        hint="Rename your columns to 'chosen'/'rejected' (and optionally 'prompt').",
    )
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(
            f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}."
        )
    if max_length is not None and max_prompt_length is not None and max_prompt_length >= max_length:
        raise ValueError(
            f"max_prompt_length ({max_prompt_length}) must be smaller than max_length ({max_length}) "
            "to leave room for the completions."
        )
    if tokenizer.eos_token is None:
        raise ValueError("The tokenizer has no eos_token; set one before preparing DPO data.")
    truncation = {
        "max_prompt_length": max_prompt_length,
        "max_completion_length": max_completion_length,
        "max_length": max_length,
        "truncation_mode": truncation_mode,
    }
    n_before = len(dataset)
    dataset = dataset.map(
        _tokenize_pair,
        fn_kwargs={
            "tokenizer": tokenizer,
            "eos_token": tokenizer.eos_token,
            "truncation": truncation,
        },
        remove_columns=dataset.column_names,
        features=token_features(list(_EMPTY)),
        num_proc=num_proc,
    )
    dataset = dataset.filter(lambda ex: len(ex["chosen_input_ids"]) > 0, num_proc=num_proc)
    if len(dataset) == 0:
        raise ValueError(
            f"All {n_before} preference examples have an empty chosen or rejected completion; "
            "check the 'chosen'/'rejected' columns."
        )
    if len(dataset) < n_before:
        warnings.warn(
            f"Dropped {n_before - len(dataset)} of {n_before} preference examples with an empty "
            "chosen or rejected completion.",
            stacklevel=2,
        )
    return dataset
