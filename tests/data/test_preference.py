"""DPO preparation: explicit/implicit prompts, chat data, EOS, TRL truncation order, empties."""

import pytest
from datasets import Dataset

from jaxrl.data import prepare_preference_dataset


def enc(tok, text):
    return tok(text)["input_ids"]


def row(tok, prompt, chosen, rejected):
    return {
        "prompt_input_ids": enc(tok, prompt),
        "chosen_input_ids": enc(tok, chosen),
        "rejected_input_ids": enc(tok, rejected),
    }


def test_explicit_prompt_appends_eos(tok):
    ds = Dataset.from_dict({"prompt": ["1+1="], "chosen": ["2"], "rejected": ["3<eos>"]})
    out = prepare_preference_dataset(ds, tok)
    assert out.column_names == ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    assert out[0] == row(tok, "1+1=", "2<eos>", "3<eos>")


def test_implicit_prompt_is_extracted(tok):
    ds = Dataset.from_dict({"chosen": ["Q: hi A: yes"], "rejected": ["Q: hi A: no"]})
    assert prepare_preference_dataset(ds, tok)[0] == row(tok, "Q: hi A:", " yes<eos>", " no<eos>")


def test_conversational_implicit_prompt_uses_chat_template(tok):
    user = {"role": "user", "content": "hi"}
    ds = Dataset.from_dict(
        {
            "chosen": [[user, {"role": "assistant", "content": "yo"}]],
            "rejected": [[user, {"role": "assistant", "content": "no"}]],
        }
    )
    # the chat template ends assistant turns with <eos>; no second EOS is added
    assert prepare_preference_dataset(ds, tok)[0] == row(tok, "U:hi\nA:", "yo<eos>", "no<eos>")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # 6 + 3 > 7: prompt cut to its last 4 tokens, then it fits
        ({"max_length": 7, "max_prompt_length": 4}, ("cdef", "xy<eos>", "z<eos>")),
        (
            {"max_length": 7, "max_prompt_length": 4, "truncation_mode": "keep_start"},
            ("abcd", "xy<eos>", "z<eos>"),
        ),
        # still 4 + 3 > 6: completions cut to max_length - max_prompt_length = 2
        ({"max_length": 6, "max_prompt_length": 4}, ("cdef", "xy", "z<eos>")),
        ({"max_completion_length": 1}, ("abcdef", "x", "z")),
        ({"max_length": None, "max_prompt_length": 2}, ("abcdef", "xy<eos>", "z<eos>")),
    ],
)
def test_truncation_order(tok, kwargs, expected):
    ds = Dataset.from_dict({"prompt": ["abcdef"], "chosen": ["xy"], "rejected": ["z"]})
    assert prepare_preference_dataset(ds, tok, **kwargs)[0] == row(tok, *expected)


def test_empty_completion_dropped_and_all_empty_errors(tok):
    ds = Dataset.from_dict({"prompt": ["a", "b"], "chosen": ["", "x"], "rejected": ["y", "z"]})
    with pytest.warns(UserWarning, match="Dropped 1 of 2"):
        out = prepare_preference_dataset(ds, tok)
    assert out[0] == row(tok, "b", "x<eos>", "z<eos>")
    with pytest.raises(ValueError, match="empty chosen or rejected"):
        prepare_preference_dataset(ds.select([0]), tok)


def test_missing_columns_and_bad_lengths(tok):
    with pytest.raises(ValueError, match=r"\['prompt', 'response'\].*chosen"):
        prepare_preference_dataset(Dataset.from_dict({"prompt": ["a"], "response": ["b"]}), tok)
    ds = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    with pytest.raises(ValueError, match="max_prompt_length"):
        prepare_preference_dataset(ds, tok, max_length=8, max_prompt_length=8)
