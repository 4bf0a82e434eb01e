"""Embedded arithmetic task: determinism, disjoint splits, shipped assets, scoring."""

import json

import numpy as np
from datasets import Dataset

from jaxrl.data import collate_sft, prepare_sft_dataset, task


def test_splits_disjoint_and_complete():
    train = {tuple(p) for p in task.operand_pairs("train").tolist()}
    test = {tuple(p) for p in task.operand_pairs("test").tolist()}
    assert len(test) == task.NUM_HELD_OUT_PAIRS and not train & test
    assert len(train | test) == 90 * 90


def test_generation_is_deterministic_and_correct():
    a = task.sft_examples("train", 50, seed=3)
    assert a == task.sft_examples("train", 50, seed=3)
    assert a != task.sft_examples("train", 50, seed=4)
    assert all(task.is_correct(ex["prompt"], ex["completion"]) for ex in a)
    prefs = task.preference_examples("test", 200)
    assert all(task.is_correct(p["prompt"], p["chosen"]) for p in prefs)
    assert not any(task.is_correct(p["prompt"], p["rejected"]) for p in prefs)
    # 15 + 17 = 32: dropped carry 22, +-10, or one digit +-1
    expected = {"22", "42", "31", "33"}
    assert {task.wrong_answer(15, 17, np.random.default_rng(s)) for s in range(50)} == expected


def test_shipped_assets_match_generator_and_are_disjoint():
    def read(name):
        return [json.loads(line) for line in task.asset_path(name).read_text().splitlines()]

    train, test = read("sft_train.jsonl"), read("sft_test.jsonl")
    assert train[:20] == task.sft_examples("train", len(train), seed=0)[:20]
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in test}
    assert not {ex["prompt"] for ex in read("dpo_train.jsonl")} & {ex["prompt"] for ex in test}
    assert read("dpo_test.jsonl")[:5] == task.preference_examples("test", 500, seed=0)[:5]


def test_shipped_tokenizer_round_trip():
    tok = task.load_tokenizer()
    ids = tok("12+35=47" + tok.eos_token)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "12+35=47"
    assert ids[-1] == tok.eos_token_id and len(tok) == 16


def test_exact_match_on_collated_batch():
    tok = task.load_tokenizer()
    ds = prepare_sft_dataset(Dataset.from_list(task.sft_examples("test", 3)), tok)
    batch = collate_sft(list(ds), seq_len=16, pad_token_id=tok.pad_token_id)
    perfect = batch["targets"].copy()
    np.testing.assert_array_equal(
        task.exact_match(perfect, batch["targets"], batch["loss_mask"]), [1, 1, 1]
    )
    # predicting the EOS wrong fails the row; a wrong prediction off the mask does not matter
    wrong = perfect.copy()
    last = np.flatnonzero(batch["loss_mask"][1])[-1]
    wrong[1, last] = 5
    wrong[0, 0] = 5
    np.testing.assert_array_equal(
        task.exact_match(wrong, batch["targets"], batch["loss_mask"]), [1, 0, 1]
    )
    # each row trains on the answer digits plus EOS
    answers = [len(ex["completion"]) + 1 for ex in task.sft_examples("test", 3)]
    np.testing.assert_array_equal(batch["loss_mask"].sum(-1), answers)
    assert task.reward_fn(["12+35=", "1+1="], ["47", "3"]) == [1.0, 0.0]
