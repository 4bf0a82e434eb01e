"""Regenerate the embedded default model assets under `jaxrl/assets/arith/`.

1. `model_config/config.json`: the tiny Qwen2-shaped config the embedded SFT job trains from
   scratch (`python -m jaxrl.train --algo sft`).
2. `sft_model/`: that config after a short SFT run on the task, the starting point of the
   embedded reward and DPO jobs. It is trained on purpose only part-way, so DPO has room to
   improve held-out accuracy.

Run from the repository root: `python examples/make_default_model.py [--max_steps N]`.
"""

import shutil
import sys
from pathlib import Path

from transformers import Qwen2Config

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.data import task
from jaxrl.train import argmax_logits, task_compute_metrics

ASSETS = Path(task.ASSETS_DIR)


def model_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
    )


def main(max_steps: int = 400) -> None:
    tok = task.load_tokenizer()
    cfg = model_config(len(tok))
    cfg.save_pretrained(ASSETS / "model_config")
    args = SFTConfig(
        output_dir="/tmp/jaxrl_make_default_model",
        max_steps=max_steps,
        learning_rate=1e-3,
        per_device_train_batch_size=64,
        mesh_fsdp=1,
        mesh_data=-1,
        bf16=False,
        logging_steps=50,
        eval_strategy="steps",
        eval_steps=max(1, max_steps // 6),
        save_strategy="no",
        warmup_steps=20,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        cfg,
        args=args,
        train_dataset=str(task.asset_path("sft_train.jsonl")),
        eval_dataset=str(task.asset_path("sft_test.jsonl")),
        processing_class=tok,
        compute_metrics=task_compute_metrics,
        preprocess_logits_for_metrics=argmax_logits,
    )
    trainer.train()
    out = ASSETS / "sft_model"
    shutil.rmtree(out, ignore_errors=True)
    trainer.save_model(str(out))
    (out / "jaxrl_config.json").unlink(missing_ok=True)
    (out / "README.md").unlink(missing_ok=True)  # the card names library versions: not shipped
    print("eval:", trainer.state.log_history[-2])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
