"""`bench --algo grpo --lengths longtail` forces the same completion lengths on both sides:
jaxrl's rollouts and TRL's `generate` end row i after lengths[i] tokens, the last one EOS."""

from __future__ import annotations

import types

import numpy as np
import torch
from onpolicy_utils import RecordingReward, prompt_rows
from trainer_utils import base_args

from jaxrl.bench import grpo_lengths
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig

LENGTHS = np.array([1, 6, 2, 3, 1, 2, 6, 4], np.int32)


def test_jaxrl_rollouts_end_at_the_forced_lengths(hf_model_dir, tokenizer, tmp_path):
    reward = RecordingReward()
    args = base_args(
        tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        max_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        hf_model_dir, reward_funcs=reward, args=GRPOConfig(**args),
        train_dataset=prompt_rows(8), processing_class=tokenizer,
    )  # fmt: skip
    trainer._ensure_state()
    eos = tokenizer.eos_token_id
    grpo_lengths.force_jaxrl(trainer, LENGTHS, eos)
    trainer.train()
    ids = reward.calls[0]["ids"]
    assert [len(row) for row in ids] == LENGTHS.tolist()
    assert all(row[-1] == eos and eos not in row[:-1] for row in ids)


def test_trl_generate_ends_at_the_forced_lengths(hf_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir)
    eos = tokenizer.eos_token_id
    grpo_lengths.force_trl(types.SimpleNamespace(model=model), LENGTHS, eos)
    ids = torch.full((8, 3), 5)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
            do_sample=True, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        )[:, 3:].numpy()  # fmt: skip
    first_eos = [int(np.flatnonzero(row == eos)[0]) + 1 for row in out]
    assert first_eos == LENGTHS.tolist()
