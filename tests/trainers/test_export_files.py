"""Exported model directories as TRL/transformers write them: `generation_config.json` (the
source model's, or derived from the config) that transformers loads with the model, and a
`README.md` model card naming the model, base model, trainer and framework versions."""

import shutil

import jax
import pytest
from trainer_utils import base_args, tiny_config

from jaxrl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.model_card import base_model_id


def _card(path):
    from huggingface_hub import ModelCard

    return ModelCard.load(str(path / "README.md"))


def test_sft_export_keeps_source_generation_config(tmp_path, tokenizer, hf_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    source = tmp_path / "source"
    shutil.copytree(hf_model_dir, source)
    GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=9, eos_token_id=1
    ).save_pretrained(source)
    trainer = SFTTrainer(
        str(source),
        args=SFTConfig(**base_args(tmp_path / "my-sft-run")),
        processing_class=tokenizer,
    )
    out = tmp_path / "export"
    trainer.save_model(str(out))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = model.generation_config
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.max_new_tokens) == (True, 0.7, 0.9, 9)
    card = _card(out)
    assert card.data.model_name == "my-sft-run"  # TRL: the output_dir's name
    assert card.data.library_name == "transformers"
    assert {"trl", "sft", "jaxrl"} <= set(card.data.tags)
    assert card.data.base_model is None  # a local path is no hub base model (TRL's rule)
    assert "trained with SFT" in card.text
    assert f"- JAX: {jax.__version__}" in card.text
    # TRL's create_model_card writes the card into output_dir with the dataset and extra tags.
    trainer.create_model_card(dataset_name="org/arith", tags="math")
    card = _card(tmp_path / "my-sft-run")
    assert card.data.datasets == ["org/arith"] and "math" in card.data.tags


def test_save_model_without_a_path_writes_output_dir(tmp_path, tokenizer, hf_model_dir):
    """HF's and TRL's default: `save_model()` writes into `args.output_dir` itself, so a TRL
    script's `from_pretrained(args.output_dir)` loads the trained model."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = SFTConfig(**base_args(tmp_path / "run"))
    trainer = SFTTrainer(hf_model_dir, args=args, processing_class=tokenizer)
    assert trainer.save_model() == args.output_dir
    model = AutoModelForCausalLM.from_pretrained(args.output_dir)
    AutoTokenizer.from_pretrained(args.output_dir)
    assert not (tmp_path / "run" / "final").exists()
    want = AutoModelForCausalLM.from_pretrained(hf_model_dir).model.embed_tokens.weight
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach(), want.detach())


def test_generation_config_derived_from_config(tmp_path, tokenizer, hf_model_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    source = tmp_path / "source"
    shutil.copytree(hf_model_dir, source)
    (source / "generation_config.json").unlink()
    trainer = SFTTrainer(
        str(source), args=SFTConfig(**base_args(tmp_path / "run")), processing_class=tokenizer
    )
    out = tmp_path / "export"
    trainer.save_model(str(out))
    want = GenerationConfig.from_model_config(tiny_config())
    got = AutoModelForCausalLM.from_pretrained(out).generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(got, key) == getattr(want, key) is not None, key


def test_reward_and_dpo_cards(tmp_path, tokenizer, hf_model_dir):
    rm = RewardTrainer(
        hf_model_dir, args=RewardConfig(**base_args(tmp_path / "rm")), processing_class=tokenizer
    )
    out = tmp_path / "rm_export"
    rm.save_model(str(out))
    # transformers writes no generation config for a sequence classifier.
    assert not (out / "generation_config.json").exists()
    card = _card(out)
    assert "reward-trainer" in card.data.tags and "trained with Reward" in card.text
    assert card.data.pipeline_tag == "text-classification"

    dpo = DPOTrainer(
        hf_model_dir, args=DPOConfig(**base_args(tmp_path / "dpo")), processing_class=tokenizer
    )
    out = tmp_path / "dpo_export"
    dpo.save_model(str(out))
    assert (out / "generation_config.json").exists()
    card = _card(out)
    assert "dpo" in card.data.tags
    assert "https://huggingface.co/papers/2305.18290" in card.text


@pytest.mark.parametrize(
    ("name", "want"), [("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"), (None, None)]
)
def test_base_model_is_a_hub_id(name, want):
    assert base_model_id(name) == want
