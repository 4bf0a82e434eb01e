"""The TRL side of BENCHMARKS.md: TRL's trainer on the same model, data, batch and lengths.

    python examples/bench_trl.py --algo {sft,dpo} [--batch 32] [--steps 30] [--warmup 5]
    python examples/bench_trl.py --algo {sft,dpo} --preset NAME --seq_len T [--batch 8] ...

Trains the shipped embedded model (`jaxrl/assets/arith/sft_model`, an HF directory) on the
embedded task data with TRL's `SFTTrainer` / `DPOTrainer` in f32 (`--bf16`: TRL's default
autocast) on this machine's GPU if it has one, else its CPU, times steps after a warm-up with a
callback (synchronising CUDA around each step), and prints one JSON line shaped like `python -m jaxrl.bench`'s.
Compare with `python -m jaxrl.bench --algo ALGO --per_device_train_batch_size B`.
With `--preset NAME --seq_len T` it trains a random-weight model of a `jaxrl.models.presets`
shape on random tokens of exactly T per row (DPO: prompt T // 2, each completion the rest, the
sigmoid loss), as `python -m jaxrl.bench --preset NAME --seq_len T` does; this is the TRL side
of `python -m jaxrl.bench --compare trl`. `--lengths longtail` gives the rows jaxrl's bench uses
with that flag (`jaxrl.bench.long_tail_lengths`, capped at T), trained in order. Needs the
`test` extra (torch, trl).
"""

import argparse
import copy
import json
import resource
import time
from types import SimpleNamespace

import numpy as np
import torch
import trl
from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from jaxrl.bench import long_tail_lengths, peak_flops
from jaxrl.data import task
from jaxrl.models import presets


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup, self.t0, self.times = warmup, None, []

    def on_step_begin(self, args, state, control, **kw):
        _sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        _sync()  # CUDA runs asynchronously: time the step's kernels, not their launch
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.t0)


class PretokenizedDPOTrainer(trl.DPOTrainer):
    """TRL's DPOTrainer on rows that already hold `prompt_ids` / `chosen_ids` / `rejected_ids`
    (the columns its own preparation produces), so random token ids need no tokenizer."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


def synthetic_dataset(
    algo: str, rows: int, seq_len: int, vocab: int, seed: int, lengths: list[int] | None = None
) -> Dataset:
    """Random token rows of exactly `seq_len`, or of `lengths[i]` for row i (DPO: prompt half,
    completions the rest), the layout and tokens of `jaxrl.bench`'s synthetic data."""
    rng = np.random.default_rng(seed)
    lengths = lengths or [seq_len] * rows

    def ids(length):
        return rng.integers(3, vocab, size=length).tolist()

    if algo == "sft":
        return Dataset.from_list([{"input_ids": ids(length)} for length in lengths])
    return Dataset.from_list(
        [
            {
                "prompt_ids": ids(length // 2),
                "chosen_ids": ids(length - length // 2),
                "rejected_ids": ids(length - length // 2),
            }
            for length in lengths
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["sft", "dpo"], default="dpo")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default=None, help="a jaxrl.models.presets shape (random weights)")
    p.add_argument("--seq_len", type=int, default=512, help="tokens per row with --preset")
    p.add_argument("--bf16", action="store_true", help="TRL's default bf16 autocast (else f32)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--lengths", choices=["fixed", "longtail"], default="fixed")
    p.add_argument("--padding_free", action="store_true", help="SFT: padding_free=True")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    tok = task.load_tokenizer()
    if opts.preset is None:
        model_dir = str(task.asset_path("sft_model"))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        name = "sft" if opts.algo == "sft" else "dpo"
        data = load_dataset(
            "json", data_files=str(task.asset_path(f"{name}_train.jsonl")), split="train"
        )
        max_length = 64
    else:
        torch.manual_seed(0)
        config = presets.get_preset(opts.preset)
        config._attn_implementation = opts.attn_implementation
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rows = opts.batch * (opts.warmup + opts.steps)
        lengths = None
        if opts.lengths == "longtail":  # jaxrl's bench rows with the same flag (seed 0 there too)
            lengths = long_tail_lengths(rows, opts.seq_len, seed=0)
        data = synthetic_dataset(opts.algo, rows, opts.seq_len, config.vocab_size, 0, lengths)
        max_length = opts.seq_len
    common = dict(
        output_dir="/tmp/bench_trl",
        per_device_train_batch_size=opts.batch,
        max_steps=opts.warmup + opts.steps,
        logging_steps=10,
        report_to="none",
        bf16=opts.bf16,
        use_cpu=not torch.cuda.is_available(),  # a GPU when there is one, as TRL would
        gradient_checkpointing=opts.gradient_checkpointing,
        save_strategy="no",
        max_length=max_length,
        disable_tqdm=True,
        dataloader_num_workers=0,
        # The rows in dataset order: with varying lengths, the batches jaxrl's bench trains.
        train_sampling_strategy="sequential" if opts.lengths == "longtail" else "random",
    )
    timer = StepTimer(opts.warmup)
    extra = {}
    if opts.algo == "dpo" and opts.preset is not None:
        # A random-weight model has no checkpoint path TRL could load the reference from.
        extra["ref_model"] = copy.deepcopy(model).eval()
    if opts.algo == "sft":
        if opts.padding_free:  # TRL refuses a max_length it would not enforce
            common.update(padding_free=True, max_length=None)
        cls, args = trl.SFTTrainer, trl.SFTConfig(**common)
    else:
        cls = trl.DPOTrainer if opts.preset is None else PretokenizedDPOTrainer
        args = trl.DPOConfig(**common, loss_type=["sigmoid"])
    trainer = cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[timer],
        **extra,
    )
    tokens = []
    orig = trainer.training_step

    def counting_step(model, inputs, *a, **kw):
        if "attention_mask" in inputs:
            tokens.append(int(inputs["attention_mask"].sum()))
        else:  # padding-free: one flattened row of real tokens (no pad_to_multiple_of here)
            tokens.append(int(inputs["input_ids"].numel()))
        return orig(model, inputs, *a, **kw)

    trainer.training_step = counting_step
    trainer.train()
    step_s = sum(timer.times) / len(timer.times)
    tps = sum(tokens[opts.warmup :]) / sum(timer.times)
    mfu, peak_bytes, peak_src = (
        None,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_rss",
    )
    if torch.cuda.is_available():
        peak_bytes, peak_src = int(torch.cuda.max_memory_allocated()), "device"
        peak = peak_flops(SimpleNamespace(device_kind=torch.cuda.get_device_name()))
        if opts.preset is not None and peak:
            fpt = presets.flops_per_token(config, opts.seq_len)
            if opts.algo == "dpo":  # the reference forward: a third of fwd+bwd
                fpt *= 4 / 3
            # tokens counts each DPO row as TRL runs it (prompt once per completion)
            mfu = fpt * tps / peak
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
                "mfu": mfu,
                "bf16": opts.bf16,
                "device_kind": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "preset": opts.preset,
                "seq_len": opts.seq_len if opts.preset else max_length,
                "lengths": opts.lengths,
                "peak_bytes": peak_bytes,
                "peak_bytes_source": peak_src,
            }
        )
    )


if __name__ == "__main__":
    main()
