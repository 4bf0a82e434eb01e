"""Reward preparation: prompt prepending, EOS, over-long pairs filtered, pre-tokenized, margin."""

import pytest
from datasets import Dataset

from jaxrl.data import prepare_reward_dataset


def enc(tok, text):
    return tok(text)["input_ids"]


def test_explicit_and_implicit_prompt_with_margin(tok):
    ds = Dataset.from_dict({"prompt": ["Q"], "chosen": ["a"], "rejected": ["bb"], "margin": [0.5]})
    out = prepare_reward_dataset(ds, tok)
    assert out[0] == {
        "chosen_input_ids": enc(tok, "Qa<eos>"),
        "rejected_input_ids": enc(tok, "Qbb<eos>"),
        "margin": 0.5,
    }
    implicit = prepare_reward_dataset(
        Dataset.from_dict({"chosen": ["Qa"], "rejected": ["Qb"]}), tok
    )
    assert implicit.column_names == ["chosen_input_ids", "rejected_input_ids"]
    assert implicit[0]["chosen_input_ids"] == enc(tok, "Qa<eos>")


def test_conversational(tok):
    user = {"role": "user", "content": "hi"}
    ds = Dataset.from_dict(
        {
            "prompt": [[user]],
            "chosen": [[{"role": "assistant", "content": "yo"}]],
            "rejected": [[{"role": "assistant", "content": "no"}]],
        }
    )
    assert prepare_reward_dataset(ds, tok)[0]["rejected_input_ids"] == enc(tok, "U:hi\nA:no<eos>")


def test_overlong_pairs_are_filtered_not_truncated(tok):
    ds = Dataset.from_dict({"chosen": ["ab", "abcd"], "rejected": ["c", "d"]})
    with pytest.warns(UserWarning, match="Dropped 1 of 2"):
        out = prepare_reward_dataset(ds, tok, max_length=3)
    assert out["chosen_input_ids"] == [enc(tok, "ab<eos>")]
    with pytest.raises(ValueError, match="max_length=2"):
        prepare_reward_dataset(ds, tok, max_length=2)


def test_pretokenized_with_attention_masks(tok):
    ds = Dataset.from_dict(
        {
            "input_ids_chosen": [[5, 6, 0]],
            "attention_mask_chosen": [[1, 1, 0]],
            "input_ids_rejected": [[7, 0, 0]],
            "attention_mask_rejected": [[1, 0, 0]],
        }
    )
    assert prepare_reward_dataset(ds, tok)[0] == {
        "chosen_input_ids": [5, 6],
        "rejected_input_ids": [7],
    }


def test_missing_columns(tok):
    with pytest.raises(ValueError, match=r"\['good', 'bad'\]|\['bad', 'good'\]"):
        prepare_reward_dataset(Dataset.from_dict({"good": ["a"], "bad": ["b"]}), tok)
