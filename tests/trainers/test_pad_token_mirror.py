"""The model agrees with the tokenizer on the pad token, as TRL 1.16 makes it at construction
(sft_trainer.py / dpo_trainer.py / grpo_trainer.py set `model.config.get_text_config()
.pad_token_id` and `model.generation_config.pad_token_id` to the tokenizer's; reward_trainer.py
the config's only): the saved config.json and generation_config.json carry the pad the data was
padded with, and the model's own generation config pads with it."""

from __future__ import annotations

import json

import datasets
import pytest
from test_trl_defaults import MODEL
from trainer_utils import base_args

from jaxrl import trainers
from jaxrl.data import task


def _rows(name: str) -> datasets.Dataset:
    lines = task.asset_path(f"{name}_train.jsonl").read_text().splitlines()[:4]
    return datasets.Dataset.from_list([json.loads(line) for line in lines])


CASES = {
    "sft": (trainers.SFTConfig, trainers.SFTTrainer, "sft"),
    "dpo": (trainers.DPOConfig, trainers.DPOTrainer, "dpo"),
    "reward": (trainers.RewardConfig, trainers.RewardTrainer, "dpo"),
}


@pytest.mark.parametrize("algo", list(CASES))
def test_pad_token_reaches_the_saved_configs(algo, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    # The source config says pad 0 (`<pad>`); pad with `<eos>` (1) instead, as `--pad_token`.
    assert json.loads((MODEL / "config.json").read_text())["pad_token_id"] == 0
    eos_id = tokenizer.eos_token_id
    assert eos_id != 0
    config_cls, trainer_cls, data = CASES[algo]
    args = config_cls(**base_args(tmp_path, pad_token=tokenizer.eos_token))
    trainer = trainer_cls(model=str(MODEL), args=args, train_dataset=_rows(data))
    assert trainer.processing_class.pad_token_id == eos_id
    out = trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["pad_token_id"] == eos_id
    if algo == "reward":  # a score model does not generate: no generation config
        assert not (tmp_path / "saved" / "generation_config.json").exists()
        return
    generation = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert generation["pad_token_id"] == eos_id
    assert trainer.generation_config().pad_token_id == eos_id
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).generation_config.pad_token_id == eos_id
