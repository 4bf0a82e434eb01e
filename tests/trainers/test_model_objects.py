"""TRL's most common pattern: `model=AutoModelForCausalLM.from_pretrained(...)` (or a PeftModel,
a sequence classifier for the reward trainer, a causal LM for PPO's value-head policy). The
trainer reads the object in memory and trains as from the model's directory."""

import json

import numpy as np
import pytest
from flax import nnx
from trainer_utils import base_args, train_logs

from jaxrl import (
    PPOConfig,
    PPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_sft_on_a_transformers_model_trains_as_on_its_directory(tmp_path, sft_data, hf_model_dir):
    """No processing_class: the tokenizer comes from the object's `name_or_path`, as TRL's."""
    from transformers import AutoModelForCausalLM

    def run(model, name):
        args = SFTConfig(**base_args(tmp_path / name, max_steps=2))
        trainer = SFTTrainer(model, args=args, train_dataset=sft_data[0])
        trainer.train()
        return trainer, train_logs(trainer)

    obj, obj_logs = run(AutoModelForCausalLM.from_pretrained(hf_model_dir), "object")
    path, path_logs = run(hf_model_dir, "path")
    assert obj.model_path == hf_model_dir
    for got, want in zip(obj_logs, path_logs, strict=True):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert obj_logs[0]["loss"] != obj_logs[1]["loss"]
    a, b = _flat(obj.model), _flat(path.model)
    for key in b:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_reward_trainer_on_a_sequence_classifier(tmp_path, tokenizer, hf_model_dir):
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(hf_model_dir, num_labels=1)
    args = RewardConfig(**base_args(tmp_path / "rm"))
    trainer = RewardTrainer(rm, args=args, processing_class=tokenizer)
    want = rm.score.weight.detach().numpy().T
    np.testing.assert_array_equal(np.asarray(trainer.model.score.kernel), want)


def test_peft_model_trains_its_adapter_and_saves_it(tmp_path, tokenizer, hf_model_dir):
    import peft
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    policy = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(hf_model_dir), config)
    args = SFTConfig(**base_args(tmp_path / "run"))
    trainer = SFTTrainer(policy, args=args, processing_class=tokenizer)
    assert trainer.is_peft and trainer.lora_config.r == 2
    out = trainer.save_model()
    saved = json.loads(open(f"{out}/adapter_config.json").read())
    assert saved["base_model_name_or_path"] == hf_model_dir
    # Our adapter files name each adapted module (two layers x q_proj, v_proj).
    assert (
        sorted(t.rsplit(".", 1)[1] for t in saved["target_modules"])
        == ["q_proj"] * 2 + ["v_proj"] * 2
    )


def test_ppo_value_head_policy_from_a_causal_lm(tmp_path, tokenizer, hf_model_dir):
    from transformers import AutoModelForCausalLM

    def policy(model, name):
        config = PPOConfig(batch_size=2, mini_batch_size=2, output_dir=str(tmp_path / name))
        return PPOTrainer(config, model, tokenizer=tokenizer).model

    ours = _flat(policy(AutoModelForCausalLM.from_pretrained(hf_model_dir), "object"))
    want = _flat(policy(hf_model_dir, "path"))  # no v_head keys: a new head from the seed
    assert sorted(ours) == sorted(want) and any(k[0] == "v_head" for k in want)
    for key in want:
        np.testing.assert_array_equal(ours[key], want[key], err_msg=str(key))


def test_other_objects_are_refused(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="a transformers model or config"):
        SFTTrainer(object(), args=SFTConfig(**base_args(tmp_path)), processing_class=tokenizer)
