"""An epoch's last, partial batch trains on its real examples, as HF's default
`dataloader_drop_last=False`: `ceil(N / batch)` steps per epoch, and the short step's loss and
`num_tokens` are those of the examples left over (the copies that fill the static shape weigh 0).

With `learning_rate=0` the weights never move, so each logged step loss equals `evaluate()` on
exactly that step's examples (evaluation pads its last batch the same way, already tested)."""

import pytest
from trainer_utils import base_args, tiny_config, train_logs

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer


def _check_steps(trainer, raw, batch: int) -> None:
    n = len(raw)
    assert len(trainer.train_dataset) == n  # nothing dropped: indices address `raw` too
    steps = -(-n // batch)
    logs = train_logs(trainer)
    assert trainer.state.global_step == trainer.steps_per_epoch == len(logs) == steps
    it = trainer._train_iterator()
    for step, log in enumerate(logs):
        idx = it.indices_at(step).tolist()
        assert len(idx) == min(batch, n - step * batch)
        want = trainer.evaluate(raw.select(idx))["eval_loss"]
        assert log["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), step


def test_sft_last_partial_batch(tmp_path, tokenizer, sft_data):
    data = sft_data[0].select(range(20))
    args = base_args(tmp_path, max_steps=-1, num_train_epochs=1, learning_rate=0.0)
    trainer = SFTTrainer(
        tiny_config(), args=SFTConfig(**args), train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    _check_steps(trainer, data, 8)
    # num_tokens is a running total of the real examples' tokens only.
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert train_logs(trainer)[-1]["num_tokens"] == tokens


@pytest.mark.parametrize("loss_type", ["sigmoid", "aot"])
def test_dpo_last_partial_batch(tmp_path, tokenizer, pref_data, loss_type):
    """`aot` sorts over the batch: the filling copies must stay out of the real pairs' ranks."""
    data = pref_data[0].select(range(12))
    args = base_args(
        tmp_path, max_steps=-1, num_train_epochs=1, learning_rate=0.0, loss_type=loss_type
    )
    trainer = DPOTrainer(
        tiny_config(), args=DPOConfig(**args), train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    _check_steps(trainer, data, 8)
