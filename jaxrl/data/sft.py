"""SFT dataset preparation: any TRL SFT format -> tokenized `input_ids` + per-token `loss_mask`.

Accepted formats (TRL `SFTTrainer`): language modelling `{text}` (field name configurable),
`{prompt, completion}` (standard or conversational), conversational `{messages}`, any dataset with
a `formatting_func`, and pre-tokenized `{input_ids}` (like TRL, an `input_ids` column means the
data is already processed; see `_pretokenized_mask` for its optional mask columns).
Host-side only; the output feeds `packing.py` and `collate.collate_sft`.
"""

import warnings
from collections.abc import Callable
from typing import Any, Literal

import datasets

from jaxrl.data.formats import (
    common_prefix_length,
    example_chat_template_kwargs,
    is_conversational,
    require_columns,
    token_features,
    tokenize_text_or_messages,
)
from jaxrl.data.packing import pack_bfd, pack_wrapped

_HINT = (
    "Rename the column, set `dataset_text_field` to your text column, or pass a `formatting_func`."
)


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list) and len(value) == 0)


def _tokenize_example(
    example: dict[str, Any],
    *,
    tokenizer: Any,
    kind: str,
    text_field: str,
    eos_token: str,
    completion_only_loss: bool,
    assistant_only_loss: bool,
) -> dict[str, list[int]]:
    """One example -> {input_ids, loss_mask}; empty sources give empty lists (dropped later)."""
    if kind == "pretokenized":
        return _pretokenized_mask(example, completion_only_loss)
    # As TRL, read the example's `tools` / `chat_template_kwargs` for every example it tokenizes;
    # only the chat template uses them.
    chat_kwargs = example_chat_template_kwargs(example)
    if kind == "text":
        text = example[text_field]
        if _is_empty(text):
            return {"input_ids": [], "loss_mask": []}
        if not text.endswith(eos_token):
            text = text + eos_token  # TRL appends EOS to non-conversational text
        ids = tokenizer(text)["input_ids"]
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    if kind == "messages":
        if _is_empty(example["messages"]):
            return {"input_ids": [], "loss_mask": []}
        out = tokenize_text_or_messages(
            tokenizer,
            example["messages"],
            return_assistant_tokens_mask=assistant_only_loss,
            **chat_kwargs,
        )
        ids = out["input_ids"]
        mask = list(out["assistant_masks"]) if assistant_only_loss else [1] * len(ids)
        _check_assistant_mask(mask, assistant_only_loss)
        return {"input_ids": ids, "loss_mask": mask}
    # prompt-completion
    prompt, completion = example["prompt"], example["completion"]
    if _is_empty(completion):
        return {"input_ids": [], "loss_mask": []}
    if is_conversational(example):
        prompt_ids = tokenize_text_or_messages(
            tokenizer, prompt, add_generation_prompt=True, **chat_kwargs
        )["input_ids"]
        out = tokenize_text_or_messages(
            tokenizer,
            prompt + completion,
            return_assistant_tokens_mask=assistant_only_loss,
            **chat_kwargs,
        )
        ids = out["input_ids"]
        assistant = list(out["assistant_masks"]) if assistant_only_loss else [1] * len(ids)
        _check_assistant_mask(assistant, assistant_only_loss)
    else:
        if not completion.endswith(eos_token):
            completion = completion + eos_token
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + completion)["input_ids"]
        assistant = [1] * len(ids)
    # The completion starts where prompt and prompt+completion tokenizations diverge (TRL).
    prompt_len = common_prefix_length(prompt_ids, ids)
    completion_mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
    trained = completion_mask if completion_only_loss else [1] * len(ids)
    return {
        "input_ids": ids,
        "loss_mask": [int(a and c) for a, c in zip(assistant, trained, strict=True)],
    }


def _pretokenized_mask(example: dict[str, Any], completion_only_loss: bool) -> dict[str, list]:
    """TRL's labels for already-tokenized data (`SFTTrainer._prepare_dataset`): a `labels` column
    is used as is (-100 = no loss; jaxrl's own `loss_mask` column, 1 = trained, likewise);
    otherwise a token is trained iff every applicable mask column is 1 there: `assistant_masks`
    always, `completion_mask` only with `completion_only_loss`."""
    ids = list(example["input_ids"])
    if example.get("loss_mask") is not None:
        mask = [int(bool(m)) for m in example["loss_mask"]]
        _check_same_length(ids, mask, "loss_mask")
        return {"input_ids": ids, "loss_mask": mask}
    if example.get("labels") is not None:
        labels = list(example["labels"])
        _check_same_length(ids, labels, "labels")
        if any(lab not in (-100, tok) for lab, tok in zip(labels, ids, strict=True)):
            raise ValueError(
                "A 'labels' entry is neither -100 nor the input token at its position: jaxrl "
                "trains each token to predict the next input token, so labels can only mask "
                "tokens (-100), not change their targets."
            )
        return {"input_ids": ids, "loss_mask": [int(lab != -100) for lab in labels]}
    mask = [1] * len(ids)
    names = (["completion_mask"] if completion_only_loss else []) + ["assistant_masks"]
    for name in names:
        if example.get(name) is not None:
            bits = list(example[name])
            _check_same_length(ids, bits, name)
            mask = [int(m and b) for m, b in zip(mask, bits, strict=True)]
    return {"input_ids": ids, "loss_mask": mask}


def rows_as_given(dataset: datasets.Dataset, num_proc: int | None = None) -> datasets.Dataset:
    """TRL's `dataset_kwargs={"skip_prepare_dataset": True}`: already-tokenized rows used as
    they are (no EOS, truncation, filtering or packing; the row length is the longest row's).
    `labels` (-100 = no loss) or jaxrl's `loss_mask` mark the trained tokens, else every token
    is; mask columns without `labels` are an error, as in TRL (its collator reads only
    `labels`, so they would be silently ignored). Empty rows are dropped with a warning."""
    columns = dataset.column_names
    if "input_ids" not in columns:
        raise ValueError(
            "dataset_kwargs={'skip_prepare_dataset': True} uses the dataset as given, so it needs "
            f"an 'input_ids' column (it has {columns}); tokenize it first or drop "
            "skip_prepare_dataset."
        )
    if not {"labels", "loss_mask"} & set(columns) and {"completion_mask", "assistant_masks"} & set(
        columns
    ):
        raise ValueError(
            "The dataset has mask columns but no 'labels', and skip_prepare_dataset=True skips "
            "building labels from them, so it would train on the full sequence (TRL refuses this "
            "too). Add a 'labels' column (-100 for non-loss tokens) or drop skip_prepare_dataset."
        )
    n_before = len(dataset)
    dataset = dataset.filter(lambda ex: len(ex["input_ids"]) > 0, num_proc=num_proc)
    if len(dataset) == 0:
        raise ValueError("Every row of the SFT dataset has empty input_ids.")
    if len(dataset) < n_before:
        warnings.warn(
            f"Dropped {n_before - len(dataset)} of {n_before} SFT rows with empty input_ids.",
            stacklevel=2,
        )
    return dataset.map(
        lambda ex: _pretokenized_mask(
            {k: ex.get(k) for k in ("input_ids", "labels", "loss_mask")}, False
        ),
        remove_columns=columns,
        features=token_features(["input_ids", "loss_mask"]),
        num_proc=num_proc,
    )


def _check_same_length(ids: list, values: list, name: str) -> None:
    if len(values) != len(ids):
        raise ValueError(
            f"A pre-tokenized example has {len(ids)} input_ids but {len(values)} '{name}' "
            "entries; they must have one entry per token."
        )


def _check_assistant_mask(mask: list[int], assistant_only_loss: bool) -> None:
    if assistant_only_loss and 1 not in mask:
        raise ValueError(
            "assistant_only_loss=True but an example has no assistant tokens: the tokenizer's chat "
            "template must mark assistant turns with {% generation %} ... {% endgeneration %}. "
            "Use such a template or set assistant_only_loss=False."
        )


def _detect_kind(column_names: list[str], text_field: str, has_formatting_func: bool) -> str:
    if has_formatting_func:
        return "text"
    columns = require_columns(
        column_names,
        [("input_ids",), ("prompt", "completion"), ("messages",), (text_field,)],
        what="SFT",
        hint=_HINT,
    )
    return {
        ("prompt", "completion"): "prompt_completion",
        ("messages",): "messages",
        ("input_ids",): "pretokenized",
    }.get(columns, "text")


def prepare_sft_dataset(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    dataset_text_field: str = "text",
    max_length: int | None = 1024,
    formatting_func: Callable[[dict], str] | None = None,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    packing: bool = False,
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd",
    eos_token: str | None = None,
    num_proc: int | None = None,
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start",
    shuffle_seed: int | None = None,
) -> datasets.Dataset:
    """Tokenize an SFT dataset with TRL `SFTTrainer` semantics.

    - EOS (`eos_token` or the tokenizer's) is appended to standard text/completions lacking it;
      conversational data relies on the chat template, which renders the tokenizer's own
      `eos_token` (`SFTTrainer` sets the tokenizer's EOS to `SFTConfig.eos_token` first, as TRL).
    - `completion_only_loss=None` means True when the data has 'prompt' and 'completion' columns
      (loss on completion only), as in TRL; it cannot be combined with a `formatting_func`.
    - `assistant_only_loss=True` trains only on tokens the chat template marks with
      `{% generation %}` (conversational data only).
    - Conversational examples render with their `tools` / `chat_template_kwargs` columns.
    - Pre-tokenized data (`input_ids`): `labels` (-100 = no loss) or jaxrl's `loss_mask` is used
      as is; otherwise `assistant_masks` always applies and `completion_mask` applies with
      `completion_only_loss`, as in TRL. A `formatting_func` is ignored with a warning.
    - Without packing, sequences are truncated to their first `max_length` tokens (their last
      ones with `truncation_mode="keep_end"`, TRL's deprecated mode); with packing
      they are packed into rows of `max_length` (see `packing.py`): `"bfd"` / `"bfd_split"` rows
      keep each document's attention and targets to itself, a `"wrapped"` row is one causal
      sequence as in TRL (attention crosses documents and a document's first token is predicted
      from the one before it).
    - Examples with an empty text/completion/messages are dropped with a warning, and so are,
      as in TRL, examples left with no trained token by truncation (an example with no trained
      token that was not truncated is kept, as TRL keeps it: it counts in its batch and adds no
      loss). An error is raised if nothing is left.
    - `shuffle_seed` (TRL's `shuffle_dataset`): the rows are shuffled with it before packing and
      the result after, as `datasets.Dataset.shuffle(seed=...)` orders them in TRL.

    Returns columns `input_ids` and `loss_mask` (1 where the input token is a training target),
    plus `positions` and `segment_ids` when packed with `"bfd"` / `"bfd_split"`.
    """
    if len(dataset) == 0:
        raise ValueError("The SFT dataset is empty; pass a dataset with at least one example.")
    if eos_token is not None and eos_token not in tokenizer.get_vocab():
        raise ValueError(
            f"eos_token={eos_token!r} is not in the tokenizer vocabulary; use an existing token "
            f"(the tokenizer's is {tokenizer.eos_token!r})."
        )
    eos = eos_token if eos_token is not None else tokenizer.eos_token
    if eos is None:
        raise ValueError("The tokenizer has no eos_token; set `eos_token` in the config.")
    if packing and max_length is None:
        raise ValueError("packing=True needs a max_length (the packed row length).")
    if packing_strategy not in ("bfd", "bfd_split", "wrapped"):
        raise ValueError(
            f"packing_strategy must be 'bfd', 'bfd_split' or 'wrapped', got {packing_strategy!r}."
        )

    columns = dataset.column_names
    if completion_only_loss is None:
        # TRL: on iff the data has both a 'prompt' and a 'completion' column.
        completion_only_loss = "prompt" in columns and "completion" in columns
    if formatting_func is not None and completion_only_loss:
        raise ValueError(
            "completion_only_loss=True (the default for prompt/completion data) cannot be combined "
            "with a formatting_func (it produces plain text with no prompt/completion split). "
            "Apply the function to the dataset first, or set completion_only_loss=False."
        )
    if formatting_func is not None and "input_ids" in columns:
        warnings.warn(
            "The dataset is already tokenized (it has an 'input_ids' column), so the "
            "formatting_func is ignored (as in TRL). Remove the formatting_func or pass a dataset "
            "that is not tokenized.",
            stacklevel=2,
        )
        formatting_func = None
    if formatting_func is not None:
        dataset = dataset.map(
            lambda ex: {"text": formatting_func(ex)},
            num_proc=num_proc,
            remove_columns=columns,
        )
        dataset_text_field = "text"
    kind = _detect_kind(dataset.column_names, dataset_text_field, formatting_func is not None)
    if assistant_only_loss and not is_conversational(dataset[0]):
        raise ValueError(
            "assistant_only_loss=True needs conversational data (lists of {'role', 'content'} "
            "messages); set assistant_only_loss=False for plain text."
        )

    n_before = len(dataset)
    dataset = dataset.map(
        _tokenize_example,
        fn_kwargs={
            "tokenizer": tokenizer,
            "kind": kind,
            "text_field": dataset_text_field,
            "eos_token": eos,
            "completion_only_loss": completion_only_loss,
            "assistant_only_loss": assistant_only_loss,
        },
        remove_columns=dataset.column_names,
        features=token_features(["input_ids", "loss_mask"]),
        num_proc=num_proc,
    )
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(
            f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}."
        )
    truncate = max_length is not None and not packing
    keep = slice(None)
    if truncate:
        keep = (
            slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        )
    # Empty sources tokenize to nothing; TRL drops the examples that truncation left untrained.
    dataset = dataset.filter(
        lambda ex: len(ex["input_ids"]) > 0 and (not truncate or any(ex["loss_mask"][keep])),
        num_proc=num_proc,
    )
    if truncate:
        dataset = dataset.map(
            lambda ex: {k: ex[k][keep] for k in ("input_ids", "loss_mask")}, num_proc=num_proc
        )
    dropped = n_before - len(dataset)
    if len(dataset) == 0:
        raise ValueError(
            f"All {n_before} SFT examples are empty or have no trained token after truncation to "
            f"max_length={max_length}; check the data columns and max_length."
        )
    if dropped:
        warnings.warn(
            f"Dropped {dropped} of {n_before} SFT examples that were empty or had no trained token "
            f"after truncation to max_length={max_length}.",
            stacklevel=2,
        )
    if packing:
        if shuffle_seed is not None:
            dataset = dataset.shuffle(seed=shuffle_seed)
        if packing_strategy == "wrapped":
            dataset = pack_wrapped(dataset, max_length)
        else:
            overflow = "split" if packing_strategy == "bfd_split" else "truncate"
            dataset = pack_bfd(dataset, max_length, on_seq_length_overflow=overflow)
    if shuffle_seed is not None:
        dataset = dataset.shuffle(seed=shuffle_seed).flatten_indices()
    return dataset
