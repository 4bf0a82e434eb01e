"""SFT preparation: every TRL format, EOS, loss masks, truncation, packing, clear errors."""

import pytest
from datasets import Dataset

from jaxrl.data import prepare_sft_dataset

USER_AI = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
]


def enc(tok, text):
    return tok(text)["input_ids"]


def test_language_modeling_appends_eos_and_trains_all(tok):
    ds = Dataset.from_dict({"content": ["abc", "de<eos>"]})
    out = prepare_sft_dataset(ds, tok, dataset_text_field="content")
    assert out.column_names == ["input_ids", "loss_mask"]
    assert out["input_ids"] == [enc(tok, "abc<eos>"), enc(tok, "de<eos>")]
    assert out["loss_mask"] == [[1, 1, 1, 1], [1, 1, 1]]


def test_prompt_completion_masks_prompt_by_default(tok):
    ds = Dataset.from_dict({"prompt": ["1+1="], "completion": ["2"]})
    out = prepare_sft_dataset(ds, tok)[0]
    assert out["input_ids"] == enc(tok, "1+1=2<eos>")
    assert out["loss_mask"] == [0, 0, 0, 0, 1, 1]
    full = prepare_sft_dataset(ds, tok, completion_only_loss=False)[0]
    assert full["loss_mask"] == [1] * 6


def test_conversational_messages_and_assistant_only_loss(tok):
    ds = Dataset.from_dict({"messages": [USER_AI]})
    out = prepare_sft_dataset(ds, tok)[0]
    assert out["input_ids"] == enc(tok, "U:hi\nA:yo<eos>")
    assert out["loss_mask"] == [1] * 10
    masked = prepare_sft_dataset(ds, tok, assistant_only_loss=True)[0]
    assert masked["loss_mask"] == [0] * 7 + [1, 1, 1]  # "yo<eos>"


def test_conversational_prompt_completion(tok):
    ds = Dataset.from_dict({"prompt": [USER_AI[:1]], "completion": [USER_AI[1:]]})
    out = prepare_sft_dataset(ds, tok)[0]
    assert out["input_ids"] == enc(tok, "U:hi\nA:yo<eos>")
    assert out["loss_mask"] == [0] * 7 + [1, 1, 1]


def test_assistant_only_loss_needs_generation_template(tok_plain_template):
    ds = Dataset.from_dict({"messages": [USER_AI]})
    with pytest.raises(ValueError, match="generation"):
        prepare_sft_dataset(ds, tok_plain_template, assistant_only_loss=True)


def test_formatting_func(tok):
    ds = Dataset.from_dict({"q": ["a"], "a": ["b"]})
    out = prepare_sft_dataset(ds, tok, formatting_func=lambda ex: f"{ex['q']}={ex['a']}")[0]
    assert out["input_ids"] == enc(tok, "a=b<eos>")


def test_truncation_keeps_start_and_drops_fully_masked(tok):
    ds = Dataset.from_dict({"prompt": ["abcdef", "a"], "completion": ["g", "bcdefgh"]})
    with pytest.warns(UserWarning, match="Dropped 1 of 2"):
        out = prepare_sft_dataset(ds, tok, max_length=4)
    assert out["input_ids"] == [enc(tok, "abcd")]
    assert out["loss_mask"] == [[0, 1, 1, 1]]


def test_empty_examples_dropped_then_all_empty_errors(tok):
    ds = Dataset.from_dict({"text": ["", "ok"]})
    with pytest.warns(UserWarning, match="Dropped 1 of 2"):
        out = prepare_sft_dataset(ds, tok)
    assert out["input_ids"] == [enc(tok, "ok<eos>")]
    with pytest.raises(ValueError, match="All 1 SFT examples"):
        prepare_sft_dataset(Dataset.from_dict({"text": [""]}), tok)


def test_missing_column_error_names_columns_and_fix(tok):
    with pytest.raises(ValueError, match=r"\['body'\].*dataset_text_field"):
        prepare_sft_dataset(Dataset.from_dict({"body": ["x"]}), tok)


def test_packing_bfd_gives_segment_ids_and_positions(tok):
    ds = Dataset.from_dict({"text": ["abcdef", "ab", "abc"]})  # 7, 3, 4 tokens with EOS
    out = prepare_sft_dataset(ds, tok, packing=True, max_length=8)
    assert out.column_names == ["input_ids", "loss_mask", "positions", "segment_ids"]
    assert out["input_ids"] == [enc(tok, "abcdef<eos>"), enc(tok, "abc<eos>ab<eos>")]
    assert out["segment_ids"] == [[1] * 7, [1, 1, 1, 1, 2, 2, 2]]
    assert out["positions"] == [list(range(7)), [0, 1, 2, 3, 0, 1, 2]]


def test_packing_wrapped_keeps_every_token(tok):
    ds = Dataset.from_dict({"text": ["abcdef", "ab"]})
    out = prepare_sft_dataset(ds, tok, packing=True, packing_strategy="wrapped", max_length=4)
    assert sum(out["input_ids"], []) == enc(tok, "abcdef<eos>ab<eos>")
    # As TRL: each row is one causal sequence (no segment ids; the collator counts 0..L-1).
    assert out.column_names == ["input_ids", "loss_mask"]
    assert [len(row) for row in out["input_ids"]] == [4, 4, 2]


def test_many_leading_empty_examples_keep_int_columns(tok):
    # more empty rows than one Arrow write batch (1000) used to leave a null-typed column
    ds = Dataset.from_dict({"text": [""] * 1001 + ["ab"]})
    with pytest.warns(UserWarning, match="Dropped 1001 of 1002"):
        out = prepare_sft_dataset(ds, tok)
    assert out["input_ids"] == [enc(tok, "ab<eos>")]


def test_pretokenized_input_ids_with_labels_or_loss_mask(tok):
    ds = Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[-100, 6, 7]]})
    assert prepare_sft_dataset(ds, tok)[0] == {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    ds = Dataset.from_dict({"input_ids": [[5, 6, 7]], "loss_mask": [[0, 0, 1]]})
    assert prepare_sft_dataset(ds, tok)[0] == {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]}
