"""Data preparation against TRL 1.16's own `_prepare_dataset` (called on a stand-in trainer) on
the same character tokenizer: DPO drops prompts that fill max_length, pre-tokenized SFT masks,
per-example `tools` / `chat_template_kwargs`, and the `bfd_split` packing strategy."""

import json
import string
import types
import warnings

import numpy as np
import pytest
from conftest import CHAT_TEMPLATE
from datasets import Dataset
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.dpo_trainer import DPOTrainer as TRLDPOTrainer
from trl.trainer.reward_trainer import RewardTrainer as TRLRewardTrainer
from trl.trainer.sft_trainer import SFTTrainer as TRLSFTTrainer

from jaxrl import SFTConfig
from jaxrl.data import (
    build_char_tokenizer,
    collate_preference,
    prepare_preference_dataset,
    prepare_reward_dataset,
    prepare_sft_dataset,
)

# CHAT_TEMPLATE, preceded by the tool names and the `mode` template variable when given.
TOOLS_TEMPLATE = (
    "{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}|{% endif %}"
    "{% if mode %}M:{{ mode }}|{% endif %}" + CHAT_TEMPLATE
)
ADD = {"type": "function", "function": {"name": "add"}}
MUL = {"type": "function", "function": {"name": "mul"}}


@pytest.fixture(scope="module")
def tok_tools():
    return build_char_tokenizer(string.printable, chat_template=TOOLS_TEMPLATE)


def trl_dpo(ds, tok, max_length):
    """TRL 1.16's prepared pairs, collated (and truncated) by its `DataCollatorForPreference`:
    per row the kept token ids and completion mask."""
    args = types.SimpleNamespace(
        dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start"
    )
    out = TRLDPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), ds, tok, args, "t")
    examples = [
        {k: out[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(out))
    ]
    if not examples:
        return []
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_length)(
        examples
    )
    rows = []
    for ids, attn, comp in zip(
        batch["input_ids"], batch["attention_mask"], batch["completion_mask"], strict=True
    ):
        n = int(attn.sum())
        rows.append((ids[:n].tolist(), comp[:n].tolist()))
    return rows


def jaxrl_dpo_rows(out, tok):
    """`collate_preference`'s rows [2B]: kept token ids and per-input-token completion mask."""
    examples = [out[i] for i in range(len(out))]
    if not examples:
        return []
    width = max(len(e["prompt_input_ids"]) + max(len(e["chosen_input_ids"]), len(e["rejected_input_ids"])) for e in examples)  # fmt: skip
    batch = collate_preference(examples, width, tok.pad_token_id)
    rows = []
    for ids, attn, loss in zip(
        batch["input_ids"], batch["attention_mask"], batch["loss_mask"], strict=True
    ):
        n = int(attn.sum())
        comp = np.r_[0, loss[: n - 1]].astype(int)  # loss_mask[t] scores input token t + 1
        rows.append((ids[:n].tolist(), comp.tolist()))
    return rows


# ----------------------------------------------------------------------------- 1. DPO


@pytest.mark.parametrize("max_length", [4, 6, 9, 30])
def test_dpo_keep_start_matches_trl_and_drops_prompts_filling_max_length(tok, max_length):
    ds = Dataset.from_dict(
        {
            "prompt": ["abcdefgh", "ab", "abcdef", "a"],
            "chosen": ["xyz", "c", "uv", "bcdefghijk"],
            "rejected": ["w", "de", "t", "q"],
        }
    )
    theirs = trl_dpo(ds, tok, max_length)
    n_fill = sum(len(p) >= max_length for p in ds["prompt"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if len(theirs) == 0:
            with pytest.raises(ValueError, match="were dropped"):
                prepare_preference_dataset(
                    ds, tok, max_length=max_length, max_prompt_length=None,
                    truncation_mode="keep_start",
                )  # fmt: skip
            return
        out = prepare_preference_dataset(
            ds, tok, max_length=max_length, max_prompt_length=None, truncation_mode="keep_start"
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(out) == len(theirs) // 2 == len(ds) - n_fill
    if n_fill:
        assert any(f"Dropped {n_fill} of 4" in m and "max_length" in m for m in messages)
    else:
        assert not messages
    # chosen rows then rejected rows, as TRL's collator orders them
    assert jaxrl_dpo_rows(out, tok) == theirs


def test_dpo_config_defaults_drop_a_prompt_filling_max_length(tok):
    # DPOConfig's defaults (TRL 1.16): keep_start, no max_prompt_length.
    ds = Dataset.from_dict(
        {"prompt": ["a" * 12, "b"], "chosen": ["c", "d"], "rejected": ["e", "f"]}
    )
    with pytest.warns(UserWarning, match=r"Dropped 1 of 2 .*max_length=10"):
        out = prepare_preference_dataset(
            ds, tok, max_length=10, max_prompt_length=None, truncation_mode="keep_start"
        )
    assert out["prompt_input_ids"] == [tok("b")["input_ids"]]


def test_dpo_keep_end_cuts_the_prompt_start_and_needs_max_prompt_length(tok):
    ds = Dataset.from_dict({"prompt": ["abcdefghijkl"], "chosen": ["x"], "rejected": ["yz"]})
    # keep_end (with max_prompt_length, TRL < 1.0) keeps the end of an over-long prompt
    out = prepare_preference_dataset(ds, tok, max_length=8, max_prompt_length=4)
    assert out[0]["prompt_input_ids"] == tok("ijkl")["input_ids"]
    assert out[0]["rejected_input_ids"] == tok("yz<eos>")["input_ids"]
    # TRL 1.16's whole-sequence keep_end is not implemented: a clear error, not a wrong cut
    with pytest.raises(ValueError, match="keep_end.*max_prompt_length"):
        prepare_preference_dataset(ds, tok, max_length=8, max_prompt_length=None)


# ----------------------------------------------------------------------------- 2. SFT


def trl_sft(ds, tok, *, completion_only_loss, assistant_only_loss=False, max_length=None):
    """TRL 1.16's prepared SFT dataset -> (input_ids, per-token trained mask)."""
    args = types.SimpleNamespace(
        dataset_num_proc=None,
        dataset_text_field="text",
        assistant_only_loss=assistant_only_loss,
        max_length=max_length,
        truncation_mode="keep_start",
        shuffle_dataset=False,
    )
    fake = types.SimpleNamespace(
        _tokenizer=tok, completion_only_loss=completion_only_loss, chat_template=None
    )
    out = TRLSFTTrainer._prepare_dataset(fake, ds, tok, args, False, None, "t")
    return out["input_ids"], [[int(lab != -100) for lab in row] for row in out["labels"]]


PRETOKENIZED = {
    "input_ids": [[5, 6, 7, 8, 9], [10, 11, 12]],
    "assistant_masks": [[0, 0, 1, 1, 1], [1, 1, 0]],
    "completion_mask": [[0, 1, 1, 1, 0], [0, 1, 1]],
}


@pytest.mark.parametrize("completion_only_loss", [None, False, True])
@pytest.mark.parametrize(
    "columns",
    [("assistant_masks",), ("completion_mask",), ("assistant_masks", "completion_mask")],
)
def test_sft_pretokenized_mask_columns_match_trl(tok, columns, completion_only_loss):
    ds = Dataset.from_dict({k: PRETOKENIZED[k] for k in ("input_ids", *columns)})
    # TRL's default: completion-only loss iff the data has 'prompt' and 'completion' columns
    trl_col = bool(completion_only_loss)
    ids, mask = trl_sft(ds, tok, completion_only_loss=trl_col)
    out = prepare_sft_dataset(ds, tok, completion_only_loss=completion_only_loss)
    assert out["input_ids"] == ids
    assert out["loss_mask"] == mask


def test_sft_pretokenized_labels_win_over_mask_columns(tok):
    ds = Dataset.from_dict({**PRETOKENIZED, "labels": [[-100, 6, 7, 8, 9], [10, -100, 12]]})
    ids, mask = trl_sft(ds, tok, completion_only_loss=True)
    out = prepare_sft_dataset(ds, tok, completion_only_loss=True)
    assert (out["input_ids"], out["loss_mask"]) == (ids, mask)
    assert mask == [[0, 1, 1, 1, 1], [1, 0, 1]]


def test_sft_pretokenized_prompt_completion_columns_default_to_completion_mask(tok):
    # A dataset TRL already tokenized keeps its prompt/completion columns: the default
    # completion_only_loss is then on, and completion_mask applies.
    ds = Dataset.from_dict(
        {
            "prompt": ["ab"],
            "completion": ["c"],
            "input_ids": [[5, 6, 7]],
            "completion_mask": [[0, 0, 1]],
        }  # fmt: skip
    )
    out = prepare_sft_dataset(ds, tok)
    assert out["loss_mask"] == [[0, 0, 1]]
    assert trl_sft(ds, tok, completion_only_loss=True)[1] == [[0, 0, 1]]


def test_sft_pretokenized_fully_masked_dropped_and_bad_columns_rejected(tok):
    ds = Dataset.from_dict({"input_ids": [[5, 6], [7, 8]], "assistant_masks": [[0, 0], [0, 1]]})
    with pytest.warns(UserWarning, match="Dropped 1 of 2"):
        assert prepare_sft_dataset(ds, tok)["loss_mask"] == [[0, 1]]
    with pytest.raises(ValueError, match="3 input_ids but 2 'assistant_masks'"):
        prepare_sft_dataset(
            Dataset.from_dict({"input_ids": [[5, 6, 7]], "assistant_masks": [[1, 1]]}), tok
        )
    with pytest.raises(ValueError, match="neither -100 nor the input token"):
        prepare_sft_dataset(Dataset.from_dict({"input_ids": [[5, 6]], "labels": [[5, 9]]}), tok)


def test_sft_formatting_func_ignored_on_tokenized_data_and_rejected_with_completion_loss(tok):
    ds = Dataset.from_dict({"input_ids": [[5, 6, 7]]})
    with pytest.warns(UserWarning, match="formatting_func is ignored"):
        out = prepare_sft_dataset(ds, tok, formatting_func=lambda ex: "zzz")
    assert out["input_ids"] == [[5, 6, 7]]
    pc = Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    with pytest.raises(ValueError, match="formatting_func"):
        prepare_sft_dataset(pc, tok, formatting_func=lambda ex: ex["prompt"] + ex["completion"])
    out = prepare_sft_dataset(
        pc, tok, formatting_func=lambda ex: ex["prompt"] + ex["completion"],
        completion_only_loss=False,
    )  # fmt: skip
    assert out["input_ids"] == [tok("ab<eos>")["input_ids"]]


# ------------------------------------------------------------------ 3. bfd_split packing


def test_sft_config_accepts_bfd_split_and_maps_bfd_requeue():
    assert SFTConfig(packing_strategy="bfd_split").packing_strategy == "bfd_split"
    with pytest.warns(FutureWarning, match="bfd_split"):
        assert SFTConfig(packing_strategy="bfd-requeue").packing_strategy == "bfd_split"
    with pytest.raises(ValueError, match="packing_strategy"):
        SFTConfig(packing_strategy="bfd-split")


def test_sft_bfd_split_keeps_every_token(tok):
    ds = Dataset.from_dict({"text": ["abcdefghij", "ab"]})  # 11 and 3 tokens with EOS
    out = prepare_sft_dataset(ds, tok, packing=True, packing_strategy="bfd_split", max_length=4)
    assert sorted(sum(out["input_ids"], [])) == sorted(tok("abcdefghij<eos>ab<eos>")["input_ids"])
    assert all(len(row) <= 4 for row in out["input_ids"])
    cut = prepare_sft_dataset(ds, tok, packing=True, packing_strategy="bfd", max_length=4)
    assert len(sum(cut["input_ids"], [])) == 4 + 3  # bfd truncates the long document


# --------------------------------------------------- 4. tools / chat_template_kwargs columns


def convo_sft_data(tools_as_json: bool):
    user = [{"role": "user", "content": "hi"}]
    reply = [{"role": "assistant", "content": "yo"}]
    tools = [[ADD, MUL], None]
    return {
        "prompt": [user, user],
        "completion": [reply, reply],
        "tools": [json.dumps(t) if tools_as_json and t else t for t in tools],
        "chat_template_kwargs": [{"mode": "fast"}, {"mode": None}],
    }


@pytest.mark.parametrize("tools_as_json", [False, True])
@pytest.mark.parametrize("layout", ["prompt_completion", "messages"])
def test_sft_forwards_tools_and_chat_template_kwargs_like_trl(tok_tools, tools_as_json, layout):
    data = convo_sft_data(tools_as_json)
    if layout == "messages":
        data["messages"] = [
            p + c for p, c in zip(data.pop("prompt"), data.pop("completion"), strict=True)
        ]
    ds = Dataset.from_dict(data)
    ids, mask = trl_sft(ds, tok_tools, completion_only_loss=layout == "prompt_completion")
    out = prepare_sft_dataset(ds, tok_tools)
    assert (out["input_ids"], out["loss_mask"]) == (ids, mask)
    assert tok_tools.decode(out["input_ids"][0]).startswith("T:add;mul;|M:fast|U:hi")
    assert tok_tools.decode(out["input_ids"][1]).startswith("U:hi")
    masked = prepare_sft_dataset(ds, tok_tools, assistant_only_loss=True)
    ids, mask = trl_sft(ds, tok_tools, completion_only_loss=False, assistant_only_loss=True)
    assert (masked["input_ids"], masked["loss_mask"]) == (ids, mask)


def convo_pairs():
    user = [{"role": "user", "content": "hi"}]
    return Dataset.from_dict(
        {
            "prompt": [user, user],
            "chosen": [[{"role": "assistant", "content": "yo"}]] * 2,
            "rejected": [[{"role": "assistant", "content": "no"}]] * 2,
            "tools": [json.dumps([ADD]), None],
            "chat_template_kwargs": [{"mode": None}, {"mode": "slow"}],
        }
    )


def test_dpo_forwards_tools_and_chat_template_kwargs_like_trl(tok_tools):
    ds = convo_pairs()
    out = prepare_preference_dataset(ds, tok_tools, max_length=None, max_prompt_length=None)
    assert jaxrl_dpo_rows(out, tok_tools) == trl_dpo(ds, tok_tools, None)
    assert tok_tools.decode(out[0]["prompt_input_ids"]) == "T:add;|U:hi\nA:"
    assert tok_tools.decode(out[1]["prompt_input_ids"]) == "M:slow|U:hi\nA:"
    # implicit prompts (extracted from chosen/rejected) keep the example's columns too
    implicit = ds.map(
        lambda ex: {"chosen": ex["prompt"] + ex["chosen"], "rejected": ex["prompt"] + ex["rejected"]},
        remove_columns=["prompt"],
    )  # fmt: skip
    again = prepare_preference_dataset(implicit, tok_tools, max_length=None, max_prompt_length=None)
    assert again[:] == out[:]


def test_reward_forwards_tools_and_chat_template_kwargs_like_trl(tok_tools):
    ds = convo_pairs()
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None)
    theirs = TRLRewardTrainer._prepare_dataset(types.SimpleNamespace(), ds, tok_tools, args, "t")
    out = prepare_reward_dataset(ds, tok_tools, max_length=None)
    assert out["chosen_input_ids"] == theirs["chosen_ids"]
    assert out["rejected_input_ids"] == theirs["rejected_ids"]
    assert tok_tools.decode(out["chosen_input_ids"][0]).startswith("T:add;|U:hi")


def test_bad_chat_template_kwargs_and_tools_are_clear_errors(tok_tools):
    user = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ValueError, match="'chat_template_kwargs' column must hold a dict"):
        prepare_sft_dataset(
            Dataset.from_dict({"messages": [user], "chat_template_kwargs": ["mode=fast"]}),
            tok_tools,
        )
    with pytest.raises(ValueError, match="not valid JSON"):
        prepare_sft_dataset(Dataset.from_dict({"messages": [user], "tools": ["[{"]}), tok_tools)
