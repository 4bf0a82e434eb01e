"""Regenerate `jaxrl/assets/arith/student_model/`, the student of the embedded distillation job
(`python -m jaxrl.train --algo distill`; the teacher is the shipped `sft_model/`).

The student is a quarter of the teacher's width and half its depth (2 layers, hidden 64, ~0.1M
parameters against the teacher's ~0.8M, same tokenizer and vocabulary), given a 500-step SFT
run on the task so that it starts weak but not random: on-policy distillation then raises its
held-out accuracy toward the teacher's. Held-out greedy exact match (the 250 rows of
`sft_test.jsonl`, measured 2026-11-29 on this project's CPU): teacher 55.8%; the student after 150
SFT steps 0.6% (too weak: 120 distillation steps took it only to 7.8%), after 300 steps 7.0%,
after 500 steps 20.0% (the shipped one), after 1000 steps 90.8%: longer SFT makes the small
student better than the shipped teacher, which leaves nothing to distil.

Run from the repository root: `python examples/make_distill_student.py [--max_steps N]`.
"""

import shutil
import sys
from pathlib import Path

from transformers import Qwen2Config

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.data import task
from jaxrl.train import argmax_logits, task_compute_metrics

ASSETS = Path(task.ASSETS_DIR)


def student_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
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


def main(max_steps: int = 500) -> None:
    tok = task.load_tokenizer()
    args = SFTConfig(
        output_dir="/tmp/jaxrl_make_distill_student",
        max_steps=max_steps,
        learning_rate=1e-3,
        per_device_train_batch_size=64,
        mesh_fsdp=1,
        mesh_data=-1,
        bf16=False,
        logging_steps=50,
        eval_strategy="steps",
        eval_steps=max(1, max_steps // 3),
        save_strategy="no",
        warmup_steps=20,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        overwrite_output_dir=True,
    )
    trainer = SFTTrainer(
        student_config(len(tok)),
        args=args,
        train_dataset=str(task.asset_path("sft_train.jsonl")),
        eval_dataset=str(task.asset_path("sft_test.jsonl")),
        processing_class=tok,
        compute_metrics=task_compute_metrics,
        preprocess_logits_for_metrics=argmax_logits,
    )
    trainer.train()
    out = ASSETS / "student_model"
    shutil.rmtree(out, ignore_errors=True)
    trainer.save_model(str(out))
    (out / "jaxrl_config.json").unlink(missing_ok=True)
    (out / "README.md").unlink(missing_ok=True)  # the card names library versions: not shipped


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--max_steps") + 1]) if "--max_steps" in sys.argv else 500
    main(steps)
