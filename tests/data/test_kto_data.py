"""data.kto: TRL 1.16's KTO dataset preparation (unpairing order, EOS, KL completions rotated per
training batch, the prompt-length filter, truncation at collation) and its input errors, against
TRL's own `_prepare_dataset` output on the same tokenizer."""

import copy

import datasets
import pytest

from jaxrl.data import task
from jaxrl.data.kto import (
    collate_unpaired,
    prepare_unpaired_dataset,
    unpair_preference_rows,
    weight_advice,
)


@pytest.fixture(scope="module")
def tok():
    return task.load_tokenizer()


PAIRS = [
    {"prompt": "12+35=", "chosen": "47", "rejected": "48"},
    {"prompt": "10+10=", "chosen": "20", "rejected": "30"},
    {"prompt": "99+99=", "chosen": "198", "rejected": "188"},
]


def test_unpairing_puts_each_blocks_chosen_rows_first():
    rows = unpair_preference_rows([{**p, "extra": i} for i, p in enumerate(PAIRS)])
    assert [r["completion"] for r in rows] == ["47", "20", "198", "48", "30", "188"]
    assert [r["label"] for r in rows] == [True] * 3 + [False] * 3
    assert [r["extra"] for r in rows] == [0, 1, 2, 0, 1, 2]


def test_matches_trls_prepared_rows(tok, tmp_path):
    """Unpaired data, paired data and the KL rotation within blocks of the batch size: the same
    token ids, labels and KL completions as TRL's `KTOTrainer._prepare_dataset`."""
    import torch
    import trl
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    torch.manual_seed(0)
    unpaired = datasets.Dataset.from_list(
        [{"prompt": f"{a}+{a}=", "completion": str(a + a + i % 2), "label": i % 2 == 0}
         for i, a in enumerate(range(10, 17))]
    )  # fmt: skip
    for data in (unpaired, datasets.Dataset.from_list(PAIRS)):
        args = trl.KTOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=3, use_cpu=True,
            report_to="none", max_length=8,
        )  # fmt: skip
        theirs = trl.KTOTrainer(
            model,
            ref_model=copy.deepcopy(model),
            args=args,
            train_dataset=data,
            processing_class=tok,
        )
        ours = prepare_unpaired_dataset(data, tok, max_length=8, kl_batch_size=3)
        for key in ("prompt_ids", "completion_ids", "KL_completion_ids", "label"):
            assert ours[key] == theirs.train_dataset[key], key


def test_prompt_filter_kl_after_it_and_truncation(tok):
    data = datasets.Dataset.from_list(
        [
            {"prompt": "12+35=", "completion": "47", "label": True},
            {"prompt": "1234567890+=", "completion": "1", "label": False},  # prompt fills 8
            {"prompt": "10+10=", "completion": "2000", "label": False},
        ]
    )
    ds = prepare_unpaired_dataset(data, tok, max_length=8, kl_batch_size=2)
    assert len(ds) == 2  # the long prompt is dropped before the KL completions are assigned
    assert ds["KL_completion_ids"] == [ds["completion_ids"][1], ds["completion_ids"][0]]
    assert ds["completion_ids"][1] == tok("2000")["input_ids"] + [tok.eos_token_id]
    batch = collate_unpaired(list(ds), 8, tok.pad_token_id, max_length=8, with_kl=True)
    # prompt 6 + completion 5 tokens cut to 8: two completion tokens trained (targets 7, 8)
    assert batch["loss_mask"][1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    assert batch["KL_loss_mask"][1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    assert batch["label"].tolist() == [1.0, 0.0]
    assert apo_has_no_kl(tok, data)


def apo_has_no_kl(tok, data) -> bool:
    ds = prepare_unpaired_dataset(data, tok, max_length=None, kl_batch_size=None)
    return "KL_completion_ids" not in ds.column_names and len(ds) == 3


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "1+1=", "completion": "2"}], "'label'"),
        ([{"prompt": "1+1=", "completion": "2", "label": "yes"}], "booleans"),
        ([{"text": "1+1=2"}], "needs {prompt, completion, label}"),
    ],
)
def test_bad_input_is_a_clear_error(tok, rows, message):
    with pytest.raises(ValueError, match=message):
        prepare_unpaired_dataset(
            datasets.Dataset.from_list(rows), tok, max_length=None, kl_batch_size=2
        )


def test_weight_advice_is_trls_range():
    labels = [True] * 10 + [False] * 30
    assert "desirable_weight in [3.0, 3.99]" in weight_advice(labels, 1.0, 1.0)
    assert weight_advice(labels, 3.5, 1.0) == ""
    assert weight_advice([True, False], 1.0, 1.0) == ""
