"""Helpers shared by the trainer tests (importable by name: pytest puts this dir on sys.path)."""

import shutil
from pathlib import Path

import numpy as np
from transformers import Qwen2Config


def tiny_config(vocab_size: int = 16) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def base_args(tmp_path, **kw) -> dict:
    """Small deterministic settings: one device, f32, no progress bar, no saving."""
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        bf16=False,
        mesh_data=1,
        mesh_fsdp=1,
        mesh_tensor=1,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        seed=0,
        gradient_checkpointing=False,
        lr_scheduler_type="constant",
    )
    args.update(kw)
    return args


def killed_after_checkpoint(run_dir, step: int, out) -> None:
    """Make `out` what a run killed right after saving checkpoint `step` leaves: a copy of that
    checkpoint of the uninterrupted run in `run_dir` (the same run up to there, so the same
    bytes), without building and compiling a third trainer just to stop it."""
    name = f"checkpoint-{step}"
    shutil.copytree(Path(run_dir) / "checkpoints" / name, Path(out) / "checkpoints" / name)


def per_batch_mean(values, batch_size: int, reduce=np.mean) -> float:
    """HF/TRL's eval averaging: `reduce` over each eval batch of `batch_size` examples (the
    last one shorter), then the plain mean of the batch values."""
    values = np.asarray(values)
    return float(
        np.mean([reduce(values[i : i + batch_size]) for i in range(0, len(values), batch_size)])
    )


def train_logs(trainer) -> list[dict]:
    """Per-step training logs (no eval/summary entries)."""
    return [h for h in trainer.state.log_history if "loss" in h]


def trl_train_logs(
    trainer_cls, config_cls, model_dir, tokenizer, data, out, trainer_kwargs=None, **args
):
    """TRL's own trainer (`trl.SFTTrainer`, `trl.DPOTrainer`, ...) on the transformers model in
    `model_dir`, f32 on CPU, a constant learning rate and a log every step: `(trainer, logs)`.
    `trainer_kwargs` go to the trainer (e.g. GRPO's `reward_funcs`), `args` to its config."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=config_cls(
            output_dir=str(out),
            use_cpu=True,
            logging_steps=1,
            lr_scheduler_type="constant",
            seed=0,
            report_to="none",
            bf16=False,
            gradient_checkpointing=False,
            **args,
        ),
        train_dataset=data,
        processing_class=tokenizer,
        **(trainer_kwargs or {}),
    )
    trainer.train()
    return trainer, train_logs(trainer)


def jaxrl_trainer(trainer_cls, config_cls, model_dir, tokenizer, data, out, **args):
    """jaxrl's trainer (untrained) in `trl_train_logs`' setting: `base_args` plus `args`."""
    return trainer_cls(
        model_dir,
        args=config_cls(**base_args(out, **args)),
        train_dataset=data,
        processing_class=tokenizer,
    )


def assert_logs_match(ours: list[dict], theirs: list[dict], keys, steps: int, grad_norm=True):
    """Step-for-step agreement of two runs' training logs on `keys` (and `grad_norm`)."""
    assert len(ours) == len(theirs) == steps
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for key in keys:
            np.testing.assert_allclose(
                o[key], t[key], rtol=2e-4, atol=2e-5, err_msg=f"{key} at step {step + 1}"
            )
        if grad_norm:
            np.testing.assert_allclose(o["grad_norm"], t["grad_norm"], rtol=2e-3)


def tiny_qwen3_moe(path, tokenizer) -> str:
    """A tiny Qwen3-MoE (4 experts, 2 per token, renormalised routing) saved with `tokenizer` to
    `path`, its router logits spread so routing is far from uniform."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=2,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_gpt_oss(path, tokenizer) -> str:
    """A tiny GPT-OSS (4 experts, 2 per token, attention sinks, a sliding and a full layer,
    YaRN) saved with `tokenizer` to `path`; router logits spread and sinks drawn with std 1 so
    that routing and sinks matter."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=2,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0.0, 0.5)
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
