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
    example_chat_template_kwargs,
    extract_prompt,
    is_conversational,
    require_columns,
    token_features,
    tokenize_text_or_messages,
)

_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
# Why a pair is dropped (the temporary `_drop` column): kept, an empty completion, or a prompt that
# alone fills `max_length` under keep_start truncation (TRL 1.16 filters those out).
_KEEP, _EMPTY_COMPLETION, _PROMPT_FILLS = 0, 1, 2


def _dropped(reason: int) -> dict[str, Any]:
    return {**{k: [] for k in _COLUMNS}, "_drop": reason}


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
) -> tuple[list[int], list[int], list[int]] | None:
    """The truncated pair, or None when the prompt alone fills `max_length` (TRL 1.16 drops
    such pairs: keep_start truncation would leave no completion token)."""
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
    if len(prompt) >= max_length:
        # Only reachable without max_prompt_length (< max_length), i.e. with TRL 1.16's semantics.
        return None
    if len(prompt) + longer > max_length:
        # TRL 1.16 (max_prompt_length None): keep the first max_length tokens of prompt +
        # completion. TRL (<=0.11): cut completions to `max_length - max_prompt_length`.
        keep = max_length - (max_prompt_length if max_prompt_length is not None else len(prompt))
        chosen, rejected = chosen[:keep], rejected[:keep]
    return prompt, chosen, rejected


def _tokenize_pair(
    example: dict[str, Any], *, tokenizer: Any, eos_token: str, truncation: dict
) -> dict[str, Any]:
    chat_kwargs = example_chat_template_kwargs(example)
    example = _maybe_extract_prompt(example)
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if _is_empty(chosen) or _is_empty(rejected):
        return _dropped(_EMPTY_COMPLETION)
    if is_conversational(example):
        # Per-example `tools` / `chat_template_kwargs` go to the chat template, as in TRL.
        prompt_ids = tokenize_text_or_messages(
            tokenizer, prompt, add_generation_prompt=True, **chat_kwargs
        )["input_ids"]
        chosen_full = tokenize_text_or_messages(tokenizer, prompt + chosen, **chat_kwargs)[
            "input_ids"
        ]
        rejected_full = tokenize_text_or_messages(tokenizer, prompt + rejected, **chat_kwargs)[
            "input_ids"
        ]
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
    if n == len(chosen_full) or n == len(rejected_full):
        return _dropped(_EMPTY_COMPLETION)
    truncated = _truncate(prompt_ids[:n], chosen_full[n:], rejected_full[n:], **truncation)
    if truncated is None:
        return _dropped(_PROMPT_FILLS)
    p, c, r = truncated
    if not c or not r:
        return _dropped(_EMPTY_COMPLETION)
    return {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r, "_drop": _KEEP}


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

    Truncation, in this order:
      1. completions are cut to their first `max_completion_length` tokens;
      2. if `prompt + longer completion` exceeds `max_length` and `max_prompt_length` is set
         (TRL < 1.0), the prompt is cut to `max_prompt_length` tokens, keeping its end
         (`truncation_mode="keep_end"`, default) or its start (`"keep_start"`);
      3. without `max_prompt_length` (TRL 1.16, `truncation_mode="keep_start"` only): a pair whose
         prompt alone has `max_length` tokens or more is dropped, as TRL 1.16 filters it out
         (keep_start truncation would leave it no completion token);
      4. if it still exceeds `max_length`, completions are cut to `max_length - max_prompt_length`
         tokens (`max_length - len(prompt)` when `max_prompt_length` is None, which keeps the
         first `max_length` tokens of each `prompt + completion` as TRL 1.16's collator does).
    `max_length=None` disables steps 2-4. TRL 1.16's whole-sequence `keep_end` (which would cut
    the chosen and rejected rows' shared prompt differently) is not implemented: `keep_end` needs
    `max_prompt_length` when `max_length` is set. EOS is appended to standard completions lacking
    it. Conversational examples render with their `tools` / `chat_template_kwargs` columns, as in
    TRL. Dropped pairs (also those with an empty chosen or rejected completion) are counted in a
    warning; an error is raised if nothing is left.
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
    if truncation_mode == "keep_end" and max_length is not None and max_prompt_length is None:
        raise ValueError(
            "truncation_mode='keep_end' chooses which end of the prompt survives "
            "max_prompt_length, so it needs max_prompt_length set (TRL 1.16's deprecated "
            "whole-sequence 'keep_end' is not implemented); use truncation_mode='keep_start'."
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
        features=token_features(list(_COLUMNS), {"_drop": datasets.Value("int8")}),
        num_proc=num_proc,
    )
    reasons = dataset["_drop"]
    n_empty = sum(r == _EMPTY_COMPLETION for r in reasons)
    n_fills = sum(r == _PROMPT_FILLS for r in reasons)
    if n_empty or n_fills:
        dataset = dataset.filter(
            lambda drop: drop == _KEEP, input_columns="_drop", num_proc=num_proc
        )
    dataset = dataset.remove_columns("_drop")
    drops = [
        (n_empty, "with an empty chosen or rejected completion"),
        (
            n_fills,
            f"whose prompt alone has max_length={max_length} tokens or more (keep_start "
            "truncation would leave no completion token; TRL drops these too)",
        ),
    ]
    if len(dataset) == 0:
        raise ValueError(
            f"All {n_before} preference examples were dropped: "
            + "; ".join(f"{n} {text}" for n, text in drops if n)
            + ". Check the 'chosen'/'rejected' columns and max_length."
        )
    for n, text in drops:
        if n:
            warnings.warn(f"Dropped {n} of {n_before} preference examples {text}.", stacklevel=2)
    return dataset
