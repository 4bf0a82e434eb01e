"""TRL's `activation_offloading` (SFT, reward, DPO configs): the trainers build their model with
it, and an SFT run with it logs the same losses as without."""

import pytest
from datasets import Dataset
from trainer_utils import base_args, train_logs

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.models import from_pretrained


def test_sft_losses_unchanged_and_every_trainer_builds_with_it(
    tmp_path, hf_model_dir, tokenizer, sft_data, pref_data
):
    runs = {}
    for offload in (False, True):
        trainer = SFTTrainer(
            hf_model_dir,
            args=SFTConfig(
                **base_args(
                    tmp_path / f"sft_{offload}",
                    max_steps=2,
                    gradient_checkpointing=True,
                    activation_offloading=offload,
                )
            ),
            train_dataset=sft_data[0].select(range(16)),
            processing_class=tokenizer,
        )
        assert trainer.model.config.activation_offloading is offload
        trainer.train()
        runs[offload] = [(r["loss"], r["grad_norm"]) for r in train_logs(trainer)]
    assert len(runs[True]) == 2
    assert runs[True] == pytest.approx(runs[False], rel=1e-6)

    pairs = Dataset.from_dict({"chosen": ["1+1=2", "3+4=7"], "rejected": ["1+1=3", "3+4=8"]})
    for trainer_cls, config_cls, data in (
        (DPOTrainer, DPOConfig, pref_data[0].select(range(8))),
        (RewardTrainer, RewardConfig, pairs),
    ):
        trainer = trainer_cls(
            hf_model_dir,
            args=config_cls(
                **base_args(tmp_path / config_cls.__name__, activation_offloading=True)
            ),
            train_dataset=data,
            processing_class=tokenizer,
        )
        assert trainer.model.config.activation_offloading

    # A model object built without it is refused, not silently run without offloading.
    with pytest.raises(ValueError, match="activation_offloading=True but the given model"):
        SFTTrainer(
            from_pretrained(hf_model_dir),
            args=SFTConfig(**base_args(tmp_path / "obj", activation_offloading=True)),
            train_dataset=sft_data[0].select(range(8)),
            processing_class=tokenizer,
        )
