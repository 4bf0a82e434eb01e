"""`evaluate()` reports what TRL 1.16 reports for SFT, DPO and reward models, number for number.

HF and TRL take each metric per eval batch: `eval_loss` is the mean of the batch losses weighted
by the batches' example counts (HF's `evaluation_loop`), every other metric the plain mean of its
batch values (TRL's `log()`), a reward model's `min_reward`/`max_reward` included. Eight examples
in batches of 3 make the last batch short and the batches' token counts unequal, so a mean over
all tokens or all examples at once would differ in the third or fourth digit.
"""

import json
import math

import datasets
import numpy as np
import pytest
from test_trl_defaults import MODEL, _reward_model
from trainer_utils import base_args

from jaxrl.data import task

# HF's timing keys (checked for sanity, not value; evaluate() before training also times the
# model's preparation) and the keys only HF's torch side has.
SPEED = (
    "eval_model_preparation_time",
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
)
TORCH_ONLY = ("epoch", "step")


def _rows(algo: str) -> datasets.Dataset:
    name = "sft" if algo == "sft" else "dpo"
    lines = task.asset_path(f"{name}_train.jsonl").read_text().splitlines()[:8]
    return datasets.Dataset.from_list([json.loads(line) for line in lines])


def _trl_eval(algo: str, model: str, ds, out) -> dict:
    import trl

    config_cls, trainer_cls = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "reward": (trl.RewardConfig, trl.RewardTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
    }[algo]
    args = config_cls(
        output_dir=str(out),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_eval_batch_size=3,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=ds, eval_dataset=ds)
    trainer.evaluate()
    return trainer.state.log_history[-1]  # what TRL logs: HF's metrics plus TRL's own


def _jaxrl_eval(algo: str, model: str, ds, out) -> dict:
    from jaxrl import trainers

    config_cls, trainer_cls = {
        "sft": (trainers.SFTConfig, trainers.SFTTrainer),
        "reward": (trainers.RewardConfig, trainers.RewardTrainer),
        "dpo": (trainers.DPOConfig, trainers.DPOTrainer),
    }[algo]
    args = config_cls(**base_args(out, per_device_eval_batch_size=3))
    trainer = trainer_cls(model=model, args=args, train_dataset=ds, eval_dataset=ds)
    return trainer.evaluate()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["sft", "dpo", "reward"])
def test_evaluate_matches_trl(algo, tmp_path):
    model = str(_reward_model(tmp_path) if algo == "reward" else MODEL)
    ds = _rows(algo)
    theirs = _trl_eval(algo, model, ds, tmp_path / "trl")
    ours = _jaxrl_eval(algo, model, ds, tmp_path / "jaxrl")
    assert set(ours) == set(theirs) - set(TORCH_ONLY), (sorted(ours), sorted(theirs))
    # TRL's DPO hands its reference model to accelerate in __init__, so HF's evaluate() has no
    # model to prepare and reports no preparation time.
    assert ("eval_model_preparation_time" in ours) == (algo != "dpo")
    for key in SPEED:
        if key in ours:
            assert math.isfinite(ours[key]) and ours[key] > 0, key
    values = sorted(k for k in ours if k not in SPEED)
    np.testing.assert_allclose(
        [ours[k] for k in values], [theirs[k] for k in values], atol=2e-6, rtol=0,
        err_msg=f"{algo}: {values}",
    )  # fmt: skip


def test_model_preparation_time_as_hf(tmp_path):
    """HF: an evaluate() before any training prepares the model and reports that time as
    `eval_model_preparation_time` in its metrics and every later evaluation's; evaluations of
    a run that trained first have none."""
    from jaxrl import SFTConfig, SFTTrainer

    ds = _rows("sft")

    def trainer(out):
        args = base_args(out, max_steps=2, eval_strategy="steps", eval_steps=1)
        return SFTTrainer(str(MODEL), args=SFTConfig(**args), train_dataset=ds, eval_dataset=ds)

    first = trainer(tmp_path / "eval_first")
    prep = first.evaluate()["eval_model_preparation_time"]
    assert prep > 0  # building the sharded state and compiling the steps takes time
    first.train()
    evals = [h for h in first.state.log_history if "eval_loss" in h]
    assert len(evals) == 3 and all(h["eval_model_preparation_time"] == prep for h in evals)
    # train() after the trainer's own evaluate() continues its metrics.jsonl, as HF's
    # log_history: the output_dir guard does not take it for a previous run.
    lines = [
        json.loads(x) for x in (tmp_path / "eval_first" / "metrics.jsonl").read_text().splitlines()
    ]
    assert lines[0]["step"] == 0 and lines[0]["eval_model_preparation_time"] == prep

    trained_first = trainer(tmp_path / "train_first")
    trained_first.train()
    evals = [h for h in trained_first.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and not any("eval_model_preparation_time" in h for h in evals)
