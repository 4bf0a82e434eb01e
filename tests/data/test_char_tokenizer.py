"""Character tokenizer: ids, round trip, save/load offline with AutoTokenizer."""

import pytest
from transformers import AutoTokenizer

from jaxrl.data.char_tokenizer import build_char_tokenizer


def test_ids_round_trip_and_reload(tmp_path):
    tok = build_char_tokenizer("0123456789+=")
    enc = tok("12+35=47<eos>")["input_ids"]
    # specials 0..3, then '0'=4 ... '9'=13, '+'=14, '='=15
    assert enc == [5, 6, 14, 7, 9, 15, 8, 11, 1]
    assert tok.decode(enc) == "12+35=47<eos>"
    assert tok.decode(enc, skip_special_tokens=True) == "12+35=47"
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again("12+35=47<eos>")["input_ids"] == enc
    assert len(again) == 16
    assert again("7x")["input_ids"] == [11, again.unk_token_id]


def test_rejects_multichar_entries():
    with pytest.raises(ValueError, match="single characters"):
        build_char_tokenizer(["ab"])
