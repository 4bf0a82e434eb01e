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

`--tools calculator` benches the agentic rollout instead (`jaxrl.bench.grpo_tools`: a
calculator tool on 4-6 digit arithmetic, a tiny random tool-template Qwen2 with a scripted
policy on real decoding, since no shipped model calls tools): generation, tool and update
seconds per step on both sides (tool time: jaxrl's wall time of its concurrent tool calls,
`GRPOTrainer.tool_time_s`; TRL's sum of its sequential calls). `--tool_latency_ms MS` makes
each call sleep MS (a remote tool's latency; default 0).

`--lengths longtail` forces every completion's length on both sides (`jaxrl.bench.grpo_lengths`:
long-tailed, mean about a quarter of `max_completion_length`, a few at it, ended by EOS), so the
step time shows what the rollout engine does with a long tail.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import datasets
import jax
import numpy as np

from jaxrl.bench import grpo_lengths, grpo_tools
from jaxrl.bench.common import peak_memory, split_flags
from jaxrl.bench.generate import longtail_lengths
from jaxrl.config_cli import parse_config
from jaxrl.rewards import arith_correct
from jaxrl.train import build_trainer
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig

_FLAGS = {
    "--steps": int, "--warmup": int, "--rounds": int, "--tools": str, "--tool_latency_ms": float,
    "--lengths": str,
}  # fmt: skip
# `--tools calculator`'s defaults (any `GRPOConfig` flag given overrides them): 8 completions
# per step (2 prompts x 4), room for a call, its result and the answer.
_TOOL_DEFAULTS = [
    "--per_device_train_batch_size", "8", "--num_generations", "4",
    "--max_completion_length", "192", "--learning_rate", "1e-5",
]  # fmt: skip


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    return split_flags(
        argv, _FLAGS,
        {
            "steps": 5, "warmup": 1, "rounds": 2, "tools": None, "tool_latency_ms": 0.0,
            "lengths": "model",
        },
    )  # fmt: skip


def _jaxrl_round(trainer, n: int) -> list[tuple[float, float, float]]:
    """`n` optimizer steps; (generation_s, tool_s, update_s) of each (generation without the tool
    calls); tokens in `trainer._bench_tokens`."""
    times = []
    it = trainer._train_iterator()
    it.skip(trainer._bench_step)
    for _ in range(n):
        plan = next(it)
        tool0 = trainer.tool_time_s
        t0 = time.perf_counter()
        trainer._generate_and_score(plan)
        jax.block_until_ready(trainer.rollout)
        t1 = time.perf_counter()
        tool_s = trainer.tool_time_s - tool0
        trainer._bench_tokens.append(trainer._buffer_tokens)
        slices = np.asarray(plan.slices, np.int32)
        trainer.train_state, metrics = trainer._jit_train_step(
            trainer.train_state, trainer.rollout, slices
        )
        jax.block_until_ready(metrics)
        times.append((t1 - t0 - tool_s, tool_s, time.perf_counter() - t1))
        trainer._bench_step += 1
    return times


def _trl_round(
    args: Any,
    model_path: str,
    n: int,
    prompts: list,
    tokenizer: Any,
    tools: dict | None = None,
    lengths: np.ndarray | None = None,
) -> list[tuple[float, float, float]]:
    """`n` steps of TRL's GRPOTrainer: (generation_s, tool_s, update_s) of each. `tools`: the
    `--tools` setup (`tool`, `spent`: the tool's per-call seconds, `decoded`)."""
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
        reward_funcs=grpo_tools.calculator_correct if tools else arith_correct,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        tools=[tools["tool"]] if tools else None,
    )
    if tools:
        grpo_tools.script_trl(trainer, tokenizer, args.num_generations, tools["decoded"])
    if lengths is not None:
        grpo_lengths.force_trl(trainer, lengths, tokenizer.eos_token_id)
    gen_times: list[float] = []
    tool_times: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        spent = len(tools["spent"]) if tools else 0
        t0 = time.perf_counter()
        result = generate(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        tool_times.append(sum(tools["spent"][spent:]) if tools else 0.0)
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
    return [(g - t, t, s - g) for g, t, s in zip(gen_times, tool_times, step_times, strict=True)]


def _tool_setup(opts: dict, rest: list[str], overrides: list[str]) -> tuple[Any, dict, list]:
    """`--tools calculator`: jaxrl's trainer on the tool setup of `grpo_tools`, the TRL side's
    tool and counters, and the prompts of all rounds."""
    if opts["tools"] not in grpo_tools.TOOL_NAMES:
        raise ValueError(
            f"--tools {opts['tools']}: the GRPO bench knows the tools {list(grpo_tools.TOOL_NAMES)} "
            "(its scripted policy calls them); use --tools calculator."
        )
    if any(a.split("=", 1)[0] == "--model_name_or_path" for a in rest):
        raise ValueError(
            "--tools runs its own tiny tool-template model (no shipped model calls tools); drop "
            "--model_name_or_path."
        )
    out = tempfile.mkdtemp(prefix="jaxrl_grpo_tools_bench_")
    args, _ = parse_config(
        GRPOConfig, cli_args=[*_TOOL_DEFAULTS, "--output_dir", out, *rest, *overrides]
    )
    tokenizer = grpo_tools.tool_tokenizer()
    model_path = grpo_tools.save_model(os.path.join(out, "model"), tokenizer)
    n_prompts = args.max_steps * args.per_device_train_batch_size // args.num_generations
    rows = grpo_tools.questions(n_prompts, seed=args.seed)
    latency_s = opts["tool_latency_ms"] / 1000.0
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=grpo_tools.calculator_correct,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[grpo_tools.make_calculator(latency_s)],
    )
    trainer.model_path = model_path
    ours: dict = {"decoded": []}
    grpo_tools.script_ours(trainer, tokenizer, ours["decoded"])
    spent: list[float] = []
    theirs = {"tool": grpo_tools.make_calculator(latency_s, spent), "spent": spent, "decoded": []}
    return trainer, {"ours": ours, "theirs": theirs}, [r["prompt"] for r in rows]


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
    tools = None
    if opts["tools"] is not None:
        trainer, tools, prompts = _tool_setup(opts, rest, overrides)
    else:
        trainer = build_trainer(rest + overrides)
    a = trainer.args
    if opts["lengths"] not in ("model", "longtail"):
        raise SystemExit(f"--lengths must be model or longtail; got {opts['lengths']!r}.")
    lengths = None
    if opts["lengths"] == "longtail":
        rows = a.per_device_train_batch_size * trainer.dp
        lengths = longtail_lengths(rows, a.max_completion_length, a.seed)
    trainer._ensure_state()
    if lengths is not None:  # (the rollout sampler exists once the state does)
        grpo_lengths.force_jaxrl(trainer, lengths, trainer.tokenizer.eos_token_id)
    trainer._bench_step = 0
    trainer._bench_tokens = []
    model_path = trainer.model_path
    if tools is None:
        n = trainer.prompts_per_generation * opts["rounds"] * (opts["warmup"] + opts["steps"])
        prompts = [ex["prompt"] for ex in trainer.train_dataset.select(range(n))]
    ours, theirs, first = [], [], None
    for _ in range(opts["rounds"]):
        times = _jaxrl_round(trainer, opts["warmup"] + opts["steps"])
        first = sum(times[0]) if first is None else first
        ours += times[opts["warmup"] :]
        theirs += _trl_round(
            a, model_path, opts["warmup"] + opts["steps"], prompts, trainer.processing_class,
            tools=tools and tools["theirs"], lengths=lengths,
        )[opts["warmup"] :]  # fmt: skip
    ours_a, theirs_a = np.asarray(ours), np.asarray(theirs)
    step_s = float(np.median(ours_a.sum(1)))
    trl_step_s = float(np.median(theirs_a.sum(1)))
    peak_bytes, _ = peak_memory()
    result = {
        "algo": "grpo",
        "step_s": step_s,
        "tokens_per_sec": float(np.mean(trainer._bench_tokens)) / step_s,
        "compile_s": max(first - step_s, 0.0),
        "peak_bytes": peak_bytes,
        "mfu": None,
        "generation_s": float(np.median(ours_a[:, 0])),
        "update_s": float(np.median(ours_a[:, 2])),
        "trl_step_s": trl_step_s,
        "trl_generation_s": float(np.median(theirs_a[:, 0])),
        "trl_update_s": float(np.median(theirs_a[:, 2])),
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
    if lengths is not None:
        result.update(
            lengths="longtail",
            mean_completion_len=float(lengths.mean()),
            rows_at_cap=int((lengths == a.max_completion_length).sum()),
            generation_engine=a.generation_engine,
            num_slots=trainer.rollout_sampler.slots_for(
                len(lengths), trainer.rollout_sampler._config, 1, trainer.rollout_generation_config
            ),
        )
    if tools is not None:
        steps_run = opts["rounds"] * (opts["warmup"] + opts["steps"])
        result.update(
            tools=opts["tools"],
            tool_latency_ms=opts["tool_latency_ms"],
            policy="scripted on real decoding (jaxrl.bench.grpo_tools)",
            tool_s=float(np.median(ours_a[:, 1])),
            trl_tool_s=float(np.median(theirs_a[:, 1])),
            # Tokens the models really decoded per step (all turns), each side.
            decoded_tokens_per_step=sum(tools["ours"]["decoded"]) / steps_run,
            trl_decoded_tokens_per_step=sum(tools["theirs"]["decoded"]) / steps_run,
        )
    return result
