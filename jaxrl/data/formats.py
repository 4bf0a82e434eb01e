"""Dataset format detection and the small text/chat helpers shared by the SFT, DPO and reward prep.

Formats follow TRL's vocabulary: *standard* examples hold strings (`text`, `prompt`, `completion`,
`chosen`, `rejected`), *conversational* ones hold lists of `{"role", "content"}` messages
(`messages`, or the same keys as lists of messages). Nothing here tokenizes whole datasets; see
`sft.py`, `preference.py` and `reward.py`.
"""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import datasets

CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")


def is_conversational(example: dict[str, Any]) -> bool:
    """True when one of TRL's message-bearing keys holds a list of `{"role": ...}` dicts."""
    for key in CONVERSATIONAL_KEYS:
        value = example.get(key)
        if isinstance(value, list) and value:
            return isinstance(value[0], dict) and "role" in value[0]
    return False


def extract_prompt(example: dict[str, Sequence]) -> dict[str, Sequence]:
    """Split the shared prefix of `chosen` and `rejected` off as the `prompt` (TRL `extract_prompt`).

    Works on strings (character prefix) and on message lists (whole-turn prefix). As in TRL, a
    space right before the point where the two differ stays with the completions, and when one
    side is a prefix of the other the split happens before their last shared element.
    """
    chosen, rejected = example["chosen"], example["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def require_columns(
    column_names: Iterable[str],
    accepted: Sequence[Sequence[str]],
    *,
    what: str,
    hint: str = "",
) -> tuple[str, ...]:
    """Return the first column set in `accepted` fully present, else raise a clear `ValueError`."""
    present = set(column_names)
    for columns in accepted:
        if all(c in present for c in columns):
            return tuple(columns)
    options = " or ".join("{" + ", ".join(c) + "}" for c in accepted)
    raise ValueError(
        f"{what} dataset has columns {sorted(present)} but needs {options}. {hint}".rstrip()
    )


def common_prefix_length(ids: Sequence[int], other_ids: Sequence[int]) -> int:
    """Number of leading tokens two id sequences share (TRL `common_prefix_length`)."""
    n = 0
    for a, b in zip(ids, other_ids, strict=False):  # lengths differ: stop at the shorter
        if a != b:
            break
        n += 1
    return n


def example_chat_template_kwargs(example: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments TRL passes to `apply_chat_template` for one conversational example:
    `tools` from the example's `tools` column (a list, or a JSON string of one; None when
    absent) plus every key of its `chat_template_kwargs` column (a dict, e.g.
    `{"enable_thinking": False}`), which wins over `tools` on a clash. As in TRL's SFT, DPO and
    reward tokenization (`{"tools": tools, **example.get("chat_template_kwargs", {})}`)."""
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"The 'tools' column holds a string that is not valid JSON ({err}); give a list of "
                "tool schemas or its JSON encoding."
            ) from None
    extra = example.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(
            "The 'chat_template_kwargs' column must hold a dict of keyword arguments for the chat "
            f"template (e.g. {{'enable_thinking': False}}); got {type(extra).__name__}."
        )
    return {"tools": tools, **extra}


def tokenize_text_or_messages(tokenizer: Any, value: str | list, **chat_kwargs: Any) -> dict:
    """Tokenize a string with `tokenizer(...)` or a message list with its chat template."""
    if isinstance(value, list):
        if tokenizer.chat_template is None:
            raise ValueError(
                "The dataset is conversational (lists of {'role', 'content'} messages) but the tokenizer "
                "has no chat template. Set `tokenizer.chat_template` or convert the data to plain text."
            )
        return dict(
            tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **chat_kwargs)
        )
    return dict(tokenizer(value))


def token_features(
    names: Sequence[str], keep: datasets.Features | None = None
) -> datasets.Features:
    """Arrow schema for tokenized output: each name an int32 list, plus columns kept from `keep`.

    Declared up front so a first batch of empty lists (examples about to be dropped) cannot make
    `datasets` infer a null type that later batches fail to cast into.
    """
    features = {name: datasets.List(datasets.Value("int32")) for name in names}
    return datasets.Features({**features, **(keep or {})})


def read_chat_template(path: str) -> str:
    """TRL's `chat_template_path` given a `.jinja` / `.j2` file: its text, which becomes the
    tokenizer's chat template. (Any other path names a tokenizer whose template is cloned:
    `jaxrl.models.resize.clone_chat_template`.)"""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"chat_template_path={path!r} does not exist. Give a .jinja / .j2 template file, or "
            "a tokenizer (directory or hub id) whose chat template is cloned."
        )
    with open(path, encoding="utf-8") as f:
        return f.read()


def is_template_file_path(path: str) -> bool:
    """Whether `chat_template_path` names a template file (`.jinja` / `.j2`) rather than a
    tokenizer whose template TRL clones."""
    return str(path).endswith((".jinja", ".j2"))
