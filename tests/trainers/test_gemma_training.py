"""Training a Gemma 3 text model (sandwich norms, qk-norm, the embedding multiplier, a sliding
layer next to a full one) equals TRL 1.16's own trainers step for step: SFT and DPO; and Gemma
2 (tanh soft-capping of attention scores and logits) with SFT, through jaxrl's fused LM head."""

from pathlib import Path

import numpy as np
import pytest
from test_dpo_trl_options import METRICS as DPO_METRICS
from test_dpo_trl_options import _pairs
from test_sft_trl_options import METRICS as SFT_METRICS
from test_sft_trl_options import _prompt_completion
from trainer_utils import assert_logs_match, jaxrl_trainer, train_logs, trl_train_logs

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, tokenizer):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF starts Gemma's norm offsets at 0; random ones test their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gemma3_vlm_dir(tmp_path_factory, tokenizer, gemma_dir):
    """gemma_dir's language model inside an image-text Gemma 3 (`Gemma3ForConditionalGeneration`,
    as gemma-3-4b) with a tiny SigLIP vision tower."""
    import torch
    from transformers import (
        AutoConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text = AutoConfig.from_pretrained(gemma_dir).to_dict()
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_gemma3_vlm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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
    path = tmp_path_factory.mktemp("tiny_gemma2")
    Gemma2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _ours_and_theirs(trainer_cls, config_cls, trl_cls, trl_config_cls, data, tmp_path, tokenizer,
                     model_dir, **common):  # fmt: skip
    _, theirs = trl_train_logs(
        trl_cls, trl_config_cls, model_dir, tokenizer, data, tmp_path / "trl", **common
    )
    trainer = jaxrl_trainer(
        trainer_cls, config_cls, model_dir, tokenizer, data, tmp_path / "ours", **common
    )
    trainer.train()
    return train_logs(trainer), theirs


@pytest.mark.slow
def test_sft_matches_trl(tmp_path, tokenizer, gemma_dir):
    import trl

    ours, theirs = _ours_and_theirs(
        SFTTrainer, SFTConfig, trl.SFTTrainer, trl.SFTConfig, _prompt_completion(), tmp_path,
        tokenizer, gemma_dir, per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3,
        max_length=64,
    )  # fmt: skip
    assert_logs_match(ours, theirs, SFT_METRICS, steps=2)


@pytest.mark.slow
def test_dpo_matches_trl(tmp_path, tokenizer, gemma_dir):
    import trl

    ours, theirs = _ours_and_theirs(
        DPOTrainer, DPOConfig, trl.DPOTrainer, trl.DPOConfig, _pairs(), tmp_path, tokenizer,
        gemma_dir, per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, beta=0.1,
        max_length=64,
    )  # fmt: skip
    assert_logs_match(ours, theirs, DPO_METRICS, steps=2)


def test_gemma2_sft_matches_trl(tmp_path, tokenizer, gemma2_dir):
    import trl

    ours, theirs = _ours_and_theirs(
        SFTTrainer, SFTConfig, trl.SFTTrainer, trl.SFTConfig, _prompt_completion(), tmp_path,
        tokenizer, gemma2_dir, per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3,
        max_length=64,
    )  # fmt: skip
    assert_logs_match(ours, theirs, SFT_METRICS, steps=2)


def test_image_text_sft_matches_trl(tmp_path, tokenizer, gemma3_vlm_dir):
    """SFT of an image-text Gemma 3 on text equals TRL's (which trains the whole
    `Gemma3ForConditionalGeneration`; the vision tower gets no gradient), and the saved models
    agree: the same trained language model, the vision weights unchanged."""
    import trl
    from safetensors.numpy import load_file

    common = dict(per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3, max_length=64)
    theirs, their_logs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, gemma3_vlm_dir, tokenizer, _prompt_completion(),
        tmp_path / "trl", save_strategy="no", **common,
    )  # fmt: skip
    ours = jaxrl_trainer(
        SFTTrainer, SFTConfig, gemma3_vlm_dir, tokenizer, _prompt_completion(), tmp_path / "ours",
        **common,
    )  # fmt: skip
    ours.train()
    assert_logs_match(train_logs(ours), their_logs, SFT_METRICS, steps=2)

    theirs.save_model(str(tmp_path / "trl_final"))
    ours.save_model(str(tmp_path / "ours_final"))
    want = load_file(tmp_path / "trl_final" / "model.safetensors")
    got = load_file(tmp_path / "ours_final" / "model.safetensors")
    assert set(got) == set(want)
    source = load_file(Path(gemma3_vlm_dir) / "model.safetensors")
    for key, value in want.items():
        if key.startswith("language_model."):
            assert not np.array_equal(value, source[key]), key  # trained
            np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], source[key], err_msg=key)
            np.testing.assert_array_equal(value, source[key], err_msg=key)
