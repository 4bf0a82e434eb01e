"""HF's `EarlyStoppingCallback` and `restore_callback_states_from_checkpoint`: training stops
after `early_stopping_patience` evaluations without an improvement larger than the threshold,
and the callback's counter survives a resume through the checkpoint's `stateful_callbacks`."""

import pytest
from trainer_utils import base_args, killed_after_checkpoint

from jaxrl import EarlyStoppingCallback, SFTConfig, SFTTrainer

# Any change of the eval loss is below this, so every evaluation after the first one counts as
# "no improvement" and the patience alone decides the stopping step.
NEVER = 1e9


def sft(tmp_path, model, data, callbacks, **kw):
    args = dict(
        max_steps=8,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="loss",
        per_device_eval_batch_size=8,
    )
    args.update(kw)
    return SFTTrainer(
        model,
        args=SFTConfig(**base_args(tmp_path, **args)),
        train_dataset=data[0],
        eval_dataset=data[1].select(range(8)),
        callbacks=callbacks,
    )


@pytest.mark.parametrize("patience", [1, 3])
def test_stops_after_patience_evaluations_without_improvement(
    tmp_path, hf_model_dir, sft_data, patience
):
    stopper = EarlyStoppingCallback(
        early_stopping_patience=patience, early_stopping_threshold=NEVER
    )
    trainer = sft(tmp_path, hf_model_dir, sft_data, [stopper])
    trainer.train()
    # Step 1's evaluation sets the best metric; each later one adds 1 to the counter.
    assert trainer.state.global_step == patience + 1
    assert stopper.early_stopping_patience_counter == patience


def test_an_improvement_resets_the_counter(tmp_path, hf_model_dir, sft_data):
    """With no threshold, the eval loss of a model learning at lr 1e-3 improves at every
    evaluation, so the counter stays 0 and the run reaches max_steps."""
    stopper = EarlyStoppingCallback(early_stopping_patience=1)
    trainer = sft(tmp_path, hf_model_dir, sft_data, [stopper], max_steps=4)
    trainer.train()
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    assert trainer.state.global_step == 4 and stopper.early_stopping_patience_counter == 0


@pytest.mark.slow
def test_counter_survives_resume_only_when_restored(tmp_path, hf_model_dir, sft_data):
    """Patience 3: an uninterrupted run stops at step 4. Interrupted after step 2 (counter 1,
    saved in `stateful_callbacks`), the resumed run stops at step 4 again when the state is
    restored, and at step 5 with a fresh counter (the best metric comes back either way).

    Both resumed runs (restore=True and restore=False, once two parametrized tests that each
    trained the same interrupted run) start from copies of one interrupted run's step-2
    checkpoint, each in its own output dir."""
    first = sft(
        tmp_path / "first",
        hf_model_dir,
        sft_data,
        [EarlyStoppingCallback(3, NEVER)],
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    first.train()
    saved = first.state.stateful_callbacks["EarlyStoppingCallback"]
    assert saved["attributes"] == {"early_stopping_patience_counter": 1}
    for restore, stop_step in ((True, 4), (False, 5)):
        out = tmp_path / f"restore_{restore}"
        killed_after_checkpoint(tmp_path / "first", 2, out)
        stopper = EarlyStoppingCallback(3, NEVER)
        resumed = sft(
            out,
            hf_model_dir,
            sft_data,
            [stopper],
            save_strategy="steps",
            save_steps=1,
            restore_callback_states_from_checkpoint=restore,
        )
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == stop_step, restore


def test_needs_a_metric_and_evaluations(tmp_path, hf_model_dir, sft_data):
    with pytest.raises(ValueError, match="eval_strategy"):
        sft(tmp_path, hf_model_dir, sft_data, [EarlyStoppingCallback()], eval_strategy="no").train()
