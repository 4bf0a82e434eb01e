"""Training Gemma 2 (tanh soft-capping of attention scores and of the logits) equals TRL 1.16's
own trainers step for step: SFT through jaxrl's fused LM head (the logits cap inside its
chunked forward and backward) and DPO in TRL's two-row layout."""

import pytest
from test_dpo_trl_options import METRICS as DPO_METRICS
from test_dpo_trl_options import _pairs
from test_sft_trl_options import _prompt_completion
from trainer_utils import assert_logs_match, jaxrl_trainer, train_logs, trl_train_logs

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tokenizer):
    """A tiny Gemma 2 whose caps bend what they cap: raw attention scores and logits of a few
    units against caps of 1.0 and 2.0."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
        initializer_range=0.2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=2,
    )
    config._attn_implementation = "eager"
    model = Gemma2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_gemma2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_sft_matches_trl(tmp_path, tokenizer, gemma2_dir):
    import trl

    common = dict(
        per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, max_length=64,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    data = _prompt_completion()
    _, theirs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, gemma2_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        SFTTrainer, SFTConfig, gemma2_dir, tokenizer, data, tmp_path / "ours", **common
    )
    assert trainer.model.config.attn_logit_softcap == 1.0
    assert trainer.model.config.final_logit_softcap == 2.0
    trainer.train()
    assert_logs_match(train_logs(trainer), theirs, ("loss", "num_tokens"), steps=2)


def test_dpo_matches_trl(tmp_path, tokenizer, gemma2_dir):
    import trl

    common = dict(
        per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, beta=0.1, max_length=64
    )
    _, theirs = trl_train_logs(
        trl.DPOTrainer, trl.DPOConfig, gemma2_dir, tokenizer, _pairs(), tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        DPOTrainer, DPOConfig, gemma2_dir, tokenizer, _pairs(), tmp_path / "ours",
        prefix_sharing=False, **common,
    )  # fmt: skip
    trainer.train()
    assert_logs_match(train_logs(trainer), theirs, DPO_METRICS, steps=2)
