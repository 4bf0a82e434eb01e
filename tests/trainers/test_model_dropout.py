"""The model's own dropout in the trainers (`jaxrl.algos.model_dropout`), on a tiny GPT-2 with
TRL's checkpoint rates (embd/attn/resid 0.1): SFT always trains with it, DPO and reward with
`disable_dropout=False`, GRPO unless `disable_dropout=True`; evaluation, references and sampling
never drop; runs are reproducible and resume bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from onpolicy_utils import RecordingReward, StopAt, prompt_rows
from trainer_utils import base_args, train_logs
from transformers import GPT2Config

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig


def gpt2(rate: float = 0.1) -> GPT2Config:
    return GPT2Config(
        vocab_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, attn_pdrop=rate, resid_pdrop=rate, embd_pdrop=rate,
    )  # fmt: skip


def _losses_with_two_keys(trainer) -> tuple[float, float, float]:
    """The training loss (as the train step wraps it) of one micro-batch under two keys, and the
    eval loss of the same micro-batch."""
    trainer._ensure_state()
    state = trainer.train_state
    host = trainer._collate(list(trainer.train_dataset.select(range(4))))
    host["example_mask"] = np.ones(4, np.float32)
    mb = trainer._to_device({k: v[None] for k, v in host.items()})
    mb = {k: v[0] for k, v in mb.items()}
    train = jax.jit(trainer._with_model_dropout(trainer._loss_fn()))
    evaluate = jax.jit(trainer._loss_fn())
    a, b = (float(train(state.params, state, mb, jax.random.key(s), {})[0]) for s in (0, 1))
    return a, b, float(evaluate(state.params, state, mb, jax.random.key(0), {})[0])


def test_which_training_losses_drop(tmp_path, tokenizer, sft_data, pref_data):
    """SFT (no `disable_dropout` in TRL's SFTConfig) drops; DPO and reward drop only with
    `disable_dropout=False` (TRL's default True); the eval loss never drops."""
    sft = SFTTrainer(
        gpt2(), SFTConfig(**base_args(tmp_path / "sft")), train_dataset=sft_data[0],
        processing_class=tokenizer,
    )  # fmt: skip
    a, b, clean = _losses_with_two_keys(sft)
    assert abs(a - b) > 1e-4 and abs(a - clean) > 1e-4
    for trainer_cls, config_cls, disable in (
        (DPOTrainer, DPOConfig, True),
        (DPOTrainer, DPOConfig, False),
        (RewardTrainer, RewardConfig, False),
    ):
        trainer = trainer_cls(
            gpt2(),
            args=config_cls(**base_args(tmp_path / f"{config_cls.__name__}{disable}"),
                            disable_dropout=disable),
            train_dataset=pref_data[0],
            processing_class=tokenizer,
        )  # fmt: skip
        a, b, clean = _losses_with_two_keys(trainer)
        if disable:
            assert a == b == clean, trainer_cls.__name__
        else:
            assert abs(a - b) > 1e-5 and abs(a - clean) > 1e-5, trainer_cls.__name__


def _sft(tmp_path, tokenizer, data, rate=0.1, callbacks=None, **kw):
    trainer = SFTTrainer(
        gpt2(rate),
        SFTConfig(**base_args(tmp_path, **kw)),
        train_dataset=data[0],
        eval_dataset=data[1],
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


@pytest.mark.slow
def test_sft_dropout_resume_is_bit_exact(tmp_path, tokenizer, sft_data):
    """Two runs draw the same masks (steps 1-2 agree bit for bit); killed after step 2 (a
    checkpoint) and resumed, steps 3-4 draw those of the uninterrupted run (keys from state.rng
    and the step)."""
    kw = dict(
        max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
    )  # fmt: skip
    data = sft_data[0].select(range(32)), None
    full = _sft(tmp_path / "a", tokenizer, data, **kw)
    killed = _sft(tmp_path / "b", tokenizer, data, callbacks=[StopAt(2)], **kw)
    for x, y in zip(train_logs(full)[:2], train_logs(killed), strict=True):  # reproducible
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]
    resumed = SFTTrainer(
        gpt2(), SFTConfig(**base_args(tmp_path / "b", **kw)), train_dataset=data[0],
        processing_class=tokenizer,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    want = train_logs(full)[2:]
    got = [h for h in train_logs(resumed) if h["step"] > 2]
    assert [h["step"] for h in got] == [3, 4]
    for x, y in zip(want, got, strict=True):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]


@pytest.mark.slow
def test_dpo_dropout_never_reaches_the_reference(tmp_path, tokenizer, pref_data):
    """`disable_dropout=False`: the policy drops and its live reference forward does not: the
    first step (policy == reference) has nonzero rewards, from the policy's dropout only, and
    the same metrics as with reference log-probs precomputed by a separate (clean) pass."""
    data = pref_data[0].select(range(8))
    runs = {}
    for precompute in (False, True):
        trainer = DPOTrainer(
            gpt2(),
            args=DPOConfig(
                **base_args(tmp_path / str(precompute), max_steps=1),
                disable_dropout=False,
                precompute_ref_log_probs=precompute,
            ),
            train_dataset=data,
            processing_class=tokenizer,
        )
        trainer.train()
        runs[precompute] = train_logs(trainer)[0]
    assert abs(runs[False]["rewards/chosen"]) > 1e-4
    for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm"):
        assert runs[False][k] == pytest.approx(runs[True][k], rel=1e-5, abs=1e-6), k


@pytest.mark.slow
def test_grpo_drops_in_the_loss_forward_only(tmp_path, tokenizer):
    """GRPO's default `disable_dropout=False` drops in the policy's loss forward (another
    gradient than `True`'s) but not while sampling: both runs draw the same completions."""
    runs = {}
    for disable in (False, True):
        args = GRPOConfig(
            **base_args(
                tmp_path / str(disable), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=4, max_steps=1,
            ),
            disable_dropout=disable,
        )  # fmt: skip
        trainer = GRPOTrainer(
            gpt2(), reward_funcs=RecordingReward(), args=args, train_dataset=prompt_rows(16),
            processing_class=tokenizer,
        )  # fmt: skip
        trainer.train()
        runs[disable] = (train_logs(trainer)[0], jax.device_get(trainer.rollout))
    (on, rollout_on), (off, rollout_off) = runs[False], runs[True]
    np.testing.assert_array_equal(rollout_on["input_ids"], rollout_off["input_ids"])
    assert on["reward"] == off["reward"]
    assert on["grad_norm"] != pytest.approx(off["grad_norm"], rel=1e-4)
