"""DPO with an `sft` term (RPO): the loss and gradients do not change with
`gradient_accumulation_steps`, because the NLL is averaged over all chosen tokens of the step."""

import numpy as np
import pytest
from trainer_utils import base_args, train_logs

from jaxrl import DPOConfig, DPOTrainer


def _logs(tmp_path, model, tokenizer, data, **kw):
    args = DPOConfig(
        **base_args(
            tmp_path, max_steps=2, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], **kw
        )
    )
    trainer = DPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return train_logs(trainer)


@pytest.mark.slow
def test_sft_term_is_the_same_with_accumulation(tmp_path, tokenizer, hf_model_dir, pref_data):
    # Answers of 1-3 digits: micro-batches hold different chosen-token counts, so a per-micro-batch
    # token mean would differ from the step's token mean.
    data = pref_data[0].select(range(16))
    base = _logs(tmp_path / "a", hf_model_dir, tokenizer, data)
    accum = _logs(
        tmp_path / "b",
        hf_model_dir,
        tokenizer,
        data,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
    )
    for b, o in zip(base, accum, strict=True):
        for key in ("loss", "grad_norm", "logps/chosen"):
            np.testing.assert_allclose(o[key], b[key], rtol=2e-5, err_msg=key)
