"""RewardTrainer: TRL metrics, learning on the task's preference pairs, and an exported model
that transformers loads as AutoModelForSequenceClassification with the same scores."""

import numpy as np
import pytest
from trainer_utils import base_args, per_batch_mean, train_logs

from jaxrl import RewardConfig, RewardTrainer
from tests.model_calls import jit_call


@pytest.mark.slow  # end to end: full training runs
def test_reward_trains_and_exports(tmp_path, tokenizer, hf_model_dir, pref_data):
    import torch
    from transformers import AutoModelForSequenceClassification

    trainer = RewardTrainer(
        hf_model_dir,
        args=RewardConfig(**base_args(tmp_path, max_steps=15, learning_rate=3e-3)),
        train_dataset=pref_data[0],
        eval_dataset=pref_data[1],
        processing_class=tokenizer,
    )
    trainer.train()
    logs = train_logs(trainer)
    for key in (
        "loss",
        "accuracy",
        "margin",
        "min_reward",
        "mean_reward",
        "max_reward",
        "num_tokens",
        "grad_norm",
        "learning_rate",
    ):
        assert key in logs[0], key
    assert logs[0]["min_reward"] <= logs[0]["mean_reward"] <= logs[0]["max_reward"]
    assert np.mean([h["loss"] for h in logs[-3:]]) < np.mean([h["loss"] for h in logs[:3]])
    metrics = trainer.evaluate()
    # Accuracy = share of eval pairs whose chosen reward beats the rejected one, scored one by one.
    model = trainer.current_model()

    def score(ids):
        return float(
            np.asarray(jit_call(model, np.array([ids]), np.ones((1, len(ids)), np.int32)))[0, 0]
        )

    ds = trainer.eval_dataset
    pairs = zip(ds["chosen_input_ids"], ds["rejected_input_ids"], strict=True)
    wins = [score(c) > score(r) for c, r in pairs]
    # Averaged as TRL: each eval batch's accuracy (8 pairs, HF's default), then their mean.
    assert len(wins) % 8  # a short last batch, so this differs from the mean over all pairs
    assert metrics["eval_accuracy"] == pytest.approx(per_batch_mean(wins, 8), abs=1e-6)

    out = trainer.save_model(str(tmp_path / "rm"))
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer(["12+35=47<eos>", "12+35=48<eos>"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[:, 0].numpy()
    model = trainer.current_model()
    ours = np.asarray(model(ids.numpy(), np.ones_like(ids.numpy())))[:, 0]
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_margin_column_and_center_coefficient(tmp_path, tokenizer, hf_model_dir, pref_data):
    data = pref_data[0].add_column("margin", [0.5] * len(pref_data[0]))
    trainer = RewardTrainer(
        hf_model_dir,
        args=RewardConfig(**base_args(tmp_path, max_steps=1, center_rewards_coefficient=0.01)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    first = train_logs(trainer)[0]
    # Fresh score head: rewards ~ 0, so the loss is ~ -log sigmoid(-0.5) = 0.974.
    assert first["loss"] == pytest.approx(0.974, abs=0.05)
