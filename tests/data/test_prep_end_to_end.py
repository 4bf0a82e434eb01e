"""The data-preparation fixes through a real trainer: a DPO prompt longer than max_length is
dropped (it used to survive and crash the collator), and SFT trains with
`packing_strategy="bfd_split"` (and its TRL alias "bfd-requeue")."""

import math
import warnings

import pytest
from datasets import Dataset

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from jaxrl.data import task
from tests.trainers.trainer_utils import base_args, tiny_config


@pytest.fixture(scope="module")
def arith_tok():
    return task.load_tokenizer()


def args(tmp_path, **kw) -> dict:
    return base_args(tmp_path, per_device_train_batch_size=4, max_steps=1, **kw)


def test_dpo_drops_a_prompt_longer_than_max_length_and_trains(tmp_path, arith_tok):
    data = Dataset.from_dict(
        {
            "prompt": ["12+35=", "11+11=", "20+30=", "1234567890" * 2 + "1234=", "40+41="],
            "chosen": ["47", "22", "50", "1234567890", "81"],
            "rejected": ["48", "23", "51", "0987654321", "82"],
        }
    )
    with pytest.warns(UserWarning, match=r"Dropped 1 of 5 .*max_length=20"):
        trainer = DPOTrainer(
            tiny_config(),
            args=DPOConfig(**args(tmp_path, max_length=20)),
            train_dataset=data,
            processing_class=arith_tok,
        )
    assert len(trainer.train_dataset) == 4
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


@pytest.mark.parametrize("strategy", ["bfd_split", "bfd-requeue"])
def test_sft_bfd_split_packing_trains(tmp_path, arith_tok, strategy):
    data = Dataset.from_dict({"text": ["12+35=47", "1234567890" * 2, "11+11=22", "20+30=50"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = SFTConfig(**args(tmp_path, packing=True, packing_strategy=strategy, max_length=8))
    assert cfg.packing_strategy == "bfd_split"
    assert any(w.category is FutureWarning for w in caught) == (strategy == "bfd-requeue")
    trainer = SFTTrainer(tiny_config(), args=cfg, train_dataset=data, processing_class=arith_tok)
    # every token is kept: the 21-token document is split into 8 + 8 + 5 pieces
    n_tokens = sum(len(arith_tok(t + "<eos>")["input_ids"]) for t in data["text"])
    assert sum(len(row) for row in trainer.train_dataset["input_ids"]) == n_tokens
    assert max(max(seg) for seg in trainer.train_dataset["segment_ids"]) >= 2
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
