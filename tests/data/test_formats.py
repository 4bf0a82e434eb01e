"""Format helpers: prompt extraction matches TRL's `extract_prompt`; conversational detection."""

import pytest
from trl.data_utils import extract_prompt as trl_extract_prompt

from jaxrl.data import extract_prompt, is_conversational

CASES = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "2+2= 4", "rejected": "2+2= 5"},  # space before the split stays with completions
    {"chosen": "abc", "rejected": "abd"},
    {"chosen": "same", "rejected": "same!"},  # one is a prefix of the other
    {
        "chosen": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is blue."},
        ],
        "rejected": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is green."},
        ],
    },
]


@pytest.mark.parametrize("example", CASES)
def test_extract_prompt_matches_trl(example):
    assert extract_prompt(example) == trl_extract_prompt(example)


def test_extract_prompt_hand_computed():
    out = extract_prompt({"chosen": "Q: hi A: yes", "rejected": "Q: hi A: no"})
    assert out == {"prompt": "Q: hi A:", "chosen": " yes", "rejected": " no"}


def test_is_conversational():
    assert is_conversational({"messages": [{"role": "user", "content": "x"}]})
    assert is_conversational({"prompt": [{"role": "user", "content": "x"}], "completion": []})
    assert not is_conversational({"prompt": "x", "completion": "y"})
    assert not is_conversational({"text": "x"})
