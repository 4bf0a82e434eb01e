"""`python -m jaxrl.bench --algo grpo`: seconds per GRPO step, generation and update apart, for
jaxrl and for TRL's `GRPOTrainer` (no vLLM, PyTorch on the same host) in one run.

Both trainers start from the same model (the shipped arithmetic SFT model unless
`--model_name_or_path` is given) with the same prompts, group size, completion length, sampling
settings and reward (`jaxrl.rewards.arith_correct`). Rounds alternate between the two
(jaxrl, TRL, jaxrl, TRL, ...) so a change in machine load hits both; the first `--warmup` steps
of every round are not timed (compilation for jaxrl, allocator warm-up for TRL). Generation time
includes decoding and scoring on both sides (TRL's `_generate_and_score_completions`); update
time is the rest of the optimizer step.

Bench flags: --steps N timed steps per round (default 5), --warmup N (default 1), --rounds R
(default 2). Other flags are `GRPOConfig` fields (both sides get the same values).
Must not give one side a setting the other lacks: TRL's config is built from jaxrl's.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxrl.bench.common import peak_memory, split_flags
from jaxrl.rewards import arith_correct
from jaxrl.train import build_trainer

_FLAGS = {"--steps": int, "--warmup": int, "--rounds": int}


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    return split_flags(argv, _FLAGS, {"steps": 5, "warmup": 1, "rounds": 2})


def _jaxrl_round(trainer, n: int) -> list[tuple[float, float]]:
    """`n` optimizer steps; (generation_s, update_s) of each; tokens in `trainer._bench_tokens`."""
    times = []
    it = trainer._train_iterator()
    it.skip(trainer._bench_step)
    for _ in range(n):
        plan = next(it)
        t0 = time.perf_counter()
        trainer._generate_and_score(plan)
        jax.block_until_ready(trainer.rollout)
        t1 = time.perf_counter()
        trainer._bench_tokens.append(trainer._buffer_tokens)
        slices = np.asarray(plan.slices, np.int32)
        trainer.train_state, metrics = trainer._jit_train_step(
            trainer.train_state, trainer.rollout, slices
        )
        jax.block_until_ready(metrics)
        times.append((t1 - t0, time.perf_counter() - t1))
        trainer._bench_step += 1
    return times


def _trl_round(
    args: Any, model_path: str, n: int, prompts: list[str], tokenizer: Any
) -> list[tuple[float, float]]:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    out = tempfile.mkdtemp(prefix="trl_grpo_bench_")
    config = trl.GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        learning_rate=args.learning_rate,
        beta=args.beta,
        loss_type=args.loss_type,
        max_steps=n,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=args.seed,
    )
    data = datasets.Dataset.from_dict({"prompt": prompts})
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=arith_correct,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    gen_times: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        result = generate(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        return result

    trainer._generate_and_score_completions = timed_generate
    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            step_times.append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    trainer.train()
    return [(g, s - g) for g, s in zip(gen_times, step_times, strict=True)]


def run(argv: list[str]) -> dict:
    opts, rest = _split(argv)
    overrides = [
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--max_steps",
        str(opts["rounds"] * (opts["warmup"] + opts["steps"])),
    ]
    trainer = build_trainer(rest + overrides)
    a = trainer.args
    trainer._ensure_state()
    trainer._bench_step = 0
    trainer._bench_tokens = []
    model_path = trainer.model_path
    n_prompts = trainer.prompts_per_generation * opts["rounds"] * (opts["warmup"] + opts["steps"])
    prompts = [ex["prompt"] for ex in trainer.train_dataset.select(range(n_prompts))]
    ours, theirs, first = [], [], None
    for _ in range(opts["rounds"]):
        times = _jaxrl_round(trainer, opts["warmup"] + opts["steps"])
        first = sum(times[0]) if first is None else first
        ours += times[opts["warmup"] :]
        theirs += _trl_round(
            a, model_path, opts["warmup"] + opts["steps"], prompts, trainer.processing_class
        )[opts["warmup"] :]
    ours_a, theirs_a = np.asarray(ours), np.asarray(theirs)
    step_s = float(np.median(ours_a.sum(1)))
    trl_step_s = float(np.median(theirs_a.sum(1)))
    peak_bytes, _ = peak_memory()
    return {
        "algo": "grpo",
        "step_s": step_s,
        "tokens_per_sec": float(np.mean(trainer._bench_tokens)) / step_s,
        "compile_s": max(first - step_s, 0.0),
        "peak_bytes": peak_bytes,
        "mfu": None,
        "generation_s": float(np.median(ours_a[:, 0])),
        "update_s": float(np.median(ours_a[:, 1])),
        "trl_step_s": trl_step_s,
        "trl_generation_s": float(np.median(theirs_a[:, 0])),
        "trl_update_s": float(np.median(theirs_a[:, 1])),
        "speedup": trl_step_s / step_s,
        "generation_speedup": float(np.median(theirs_a[:, 0]) / np.median(ours_a[:, 0])),
        "completions_per_step": a.per_device_train_batch_size * trainer.dp,
        "num_generations": a.num_generations,
        "max_completion_length": a.max_completion_length,
        "timed_steps": len(ours),
        "load_avg_1m": os.getloadavg()[0],
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
    }
