"""Training a mixture-of-experts model (Qwen3-MoE: 4 experts, 2 per token, renormalised routing)
equals TRL 1.16's own trainers step for step, with the load-balancing loss
(`router_aux_loss_coef`) in the loss and the `aux_loss` metric: SFT with gradient accumulation
(TRL divides each micro-batch's aux loss by the accumulation steps), DPO in TRL's two-row layout
and with prefix sharing (the prompt counted for both rows, as TRL's two forwards count it); SFT
with LoRA on the routers and experts (PEFT's `target_parameters` adapters) from one adapter file."""

import pytest
from test_dpo_trl_options import METRICS as DPO_METRICS
from test_dpo_trl_options import _pairs
from test_sft_trl_options import _prompt_completion
from trainer_utils import (
    assert_logs_match,
    jaxrl_trainer,
    tiny_gpt_oss,
    tiny_qwen3_moe,
    train_logs,
    trl_train_logs,
)

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer, lora
from jaxrl.models import from_pretrained

COEF = 0.5  # large, so that the aux loss moves the loss and the gradients visibly


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), tokenizer)


def _ours_and_theirs(trainer_cls, config_cls, trl_cls, trl_config_cls, data, tmp_path, tokenizer,
                     model_dir, ours_only=None, **common):  # fmt: skip
    _, theirs = trl_train_logs(
        trl_cls, trl_config_cls, model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        trainer_cls, config_cls, model_dir, tokenizer, data, tmp_path / "ours",
        **common, **(ours_only or {}),
    )  # fmt: skip
    trainer.train()
    return trainer, train_logs(trainer), theirs


def test_sft_matches_trl_with_aux_loss_and_accumulation(tmp_path, tokenizer, moe_dir):
    import trl

    # Sequential sampling: the aux loss is a per-micro-batch mean, so the micro-batches must
    # hold the same examples on both sides (jaxrl's random order is numpy's, not torch's).
    # TRL averages accuracy and entropy over micro-batches, jaxrl over tokens: not compared.
    trainer, ours, theirs = _ours_and_theirs(
        SFTTrainer, SFTConfig, trl.SFTTrainer, trl.SFTConfig, _prompt_completion(), tmp_path,
        tokenizer, moe_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        train_sampling_strategy="sequential", max_steps=2, learning_rate=1e-3, max_length=64,
        router_aux_loss_coef=COEF,
    )  # fmt: skip
    assert_logs_match(ours, theirs, ("loss", "num_tokens", "aux_loss"), steps=2)
    assert trainer.model.config.hf_config.router_aux_loss_coef == COEF
    assert trainer.model.config.hf_config.output_router_logits is True


def test_gpt_oss_sft_matches_trl_with_aux_loss(tmp_path, tokenizer):
    """GPT-OSS (attention sinks, biased router and experts, clamped SwiGLU) trains as TRL's
    SFTTrainer does, the aux loss included."""
    import trl

    model_dir = tiny_gpt_oss(tmp_path / "tiny_gpt_oss", tokenizer)
    _, ours, theirs = _ours_and_theirs(
        SFTTrainer, SFTConfig, trl.SFTTrainer, trl.SFTConfig, _prompt_completion(), tmp_path,
        tokenizer, model_dir, per_device_train_batch_size=4, train_sampling_strategy="sequential",
        max_steps=2, learning_rate=1e-3, max_length=64, router_aux_loss_coef=COEF,
    )  # fmt: skip
    assert_logs_match(ours, theirs, ("loss", "num_tokens", "aux_loss"), steps=2)


DPO_COMMON = dict(
    per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, beta=0.1, max_length=64,
    router_aux_loss_coef=COEF,
)  # fmt: skip


def test_dpo_matches_trl_with_aux_loss(tmp_path, tokenizer, moe_dir):
    """TRL's DPO run on the MoE model, run once here (a module fixture for two tests was built on
    both xdist workers), is the reference for both layouts of ours: two-row batches
    (`prefix_sharing=False`) and prefix sharing, each matching it step for step."""
    import trl

    _, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, moe_dir, tokenizer, _pairs(), tmp_path / "trl",
        **DPO_COMMON,
    )  # fmt: skip
    for prefix_sharing in (False, True):
        trainer = jaxrl_trainer(
            DPOTrainer, DPOConfig, moe_dir, tokenizer, _pairs(), tmp_path / f"ours_{prefix_sharing}",
            prefix_sharing=prefix_sharing, **DPO_COMMON,
        )  # fmt: skip
        trainer.train()
        assert_logs_match(train_logs(trainer), theirs, (*DPO_METRICS, "aux_loss"), steps=2)


def test_coefficient_follows_trl(tmp_path, tokenizer, moe_dir):
    """None takes the model config's coefficient (Qwen3-MoE's default 0.001), 0.0 turns the loss
    off (no `aux_loss` metric), a nonzero one on a dense model is an error, as in TRL."""

    def make(model, **args):
        return jaxrl_trainer(
            SFTTrainer, SFTConfig, model, tokenizer, _prompt_completion(), tmp_path / str(len(args)),
            max_steps=1, **args,
        )  # fmt: skip

    assert make(moe_dir).router_aux_loss_coef == 0.001
    off = make(moe_dir, router_aux_loss_coef=0.0)
    assert off.router_aux_loss_coef == 0.0
    off.train()
    assert "aux_loss" not in train_logs(off)[0]
    assert off.model.config.hf_config.output_router_logits is False
    dense = tmp_path / "dense"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1,
        )
    ).save_pretrained(dense)  # fmt: skip
    tokenizer.save_pretrained(dense)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        make(str(dense), router_aux_loss_coef=0.01)


def test_lora_sft_on_experts_matches_trl_and_peft(tmp_path, tokenizer, moe_dir):
    """`target_modules="all-linear"`: PEFT adapts attention, and (as ParamWrappers) the routers
    and the fused experts. The same (non-zero) adapter, loaded by both, trains the same, the
    aux loss included; `lora_dropout` is 0 (PEFT refuses dropout on expert adapters)."""
    import peft
    import torch
    import trl
    from transformers import AutoModelForCausalLM

    def hf_model():
        return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)

    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    peft.get_peft_model(hf_model(), config).save_pretrained(tmp_path / "adapter")
    common = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2,
        train_sampling_strategy="sequential", max_steps=2, learning_rate=1e-3, max_length=64,
        router_aux_loss_coef=COEF,
    )  # fmt: skip
    theirs = trl.SFTTrainer(
        model=peft.PeftModel.from_pretrained(hf_model(), tmp_path / "adapter", is_trainable=True),
        args=trl.SFTConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, logging_steps=1,
            lr_scheduler_type="constant", seed=0, report_to="none", bf16=False,
            gradient_checkpointing=False, **common,
        ),
        train_dataset=_prompt_completion(),
        processing_class=tokenizer,
    )  # fmt: skip
    theirs.train()
    model = lora.load_peft_adapter(from_pretrained(moe_dir), tmp_path / "adapter")
    ours = jaxrl_trainer(
        SFTTrainer, SFTConfig, model, tokenizer, _prompt_completion(), tmp_path / "ours", **common
    )
    ours.train()
    assert_logs_match(
        train_logs(ours), train_logs(theirs), ("loss", "num_tokens", "aux_loss"), steps=2
    )
