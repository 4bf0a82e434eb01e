"""The TRL side of BENCHMARKS.md: TRL's trainer on the same model, data, batch and lengths.

    python examples/bench_trl.py --algo {sft,dpo} [--batch 32] [--steps 30] [--warmup 5]

Trains the shipped embedded model (`jaxrl/assets/arith/sft_model`, an HF directory) on the
embedded task data with TRL's `SFTTrainer` / `DPOTrainer` in f32 on this machine, times steps
after a warm-up with a callback, and prints one JSON line shaped like `python -m jaxrl.bench`'s.
Compare with `python -m jaxrl.bench --algo ALGO --per_device_train_batch_size B`.
Needs the `test` extra (torch, trl).
"""

import argparse
import json
import time

import torch
import trl
from datasets import load_dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from jaxrl.data import task


class StepTimer(TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup, self.t0, self.times = warmup, None, []

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["sft", "dpo"], default="dpo")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    tok = task.load_tokenizer()
    model_dir = str(task.asset_path("sft_model"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    name = "sft" if opts.algo == "sft" else "dpo"
    data = load_dataset(
        "json", data_files=str(task.asset_path(f"{name}_train.jsonl")), split="train"
    )
    common = dict(
        output_dir="/tmp/bench_trl",
        per_device_train_batch_size=opts.batch,
        max_steps=opts.warmup + opts.steps,
        logging_steps=10,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        max_length=64,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = StepTimer(opts.warmup)
    if opts.algo == "sft":
        cls, args = trl.SFTTrainer, trl.SFTConfig(**common)
    else:
        cls, args = trl.DPOTrainer, trl.DPOConfig(**common)
    trainer = cls(
        model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[timer]
    )
    tokens = []
    orig = trainer.training_step

    def counting_step(model, inputs, *a, **kw):
        tokens.append(int(inputs["attention_mask"].sum()))
        return orig(model, inputs, *a, **kw)

    trainer.training_step = counting_step
    trainer.train()
    step_s = sum(timer.times) / len(timer.times)
    tps = sum(tokens[opts.warmup :]) / sum(timer.times)
    print(
        json.dumps(
            {
                "algo": opts.algo,
                "framework": f"trl {trl.__version__} / torch {torch.__version__}",
                "step_s": step_s,
                "steps_per_sec": 1 / step_s,
                "tokens_per_sec": tps,
                "global_batch": opts.batch,
                "threads": opts.threads,
                "devices": 1,
                "mfu": None,
            }
        )
    )


if __name__ == "__main__":
    main()
