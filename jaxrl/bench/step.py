"""`--algo {sft,forward,reward,dpo}`: the trainer's own jitted train step, warmed up then timed.

Without `--preset` it benchmarks exactly what `python -m jaxrl.train --algo ALGO` would train
(same flags, real data); with `--preset NAME --seq_len T` a random-weight model of that shape on
synthetic rows of length T (`--lengths longtail`: a long-tailed length distribution capped at T,
each step on its own batch in order). `--algo forward` times forward+backward of the LM loss
only. Must not run other processes: comparisons with TRL live in `compare.py`.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.bench.common import (
    LENGTHS,
    long_tail_lengths,
    mfu_of,
    peak_memory,
    split_bench_flags,
    split_flags,
    synthetic_examples,
)
from jaxrl.config_cli import parse_config
from jaxrl.models import presets
from jaxrl.train import CONFIG_DIR, build_trainer
from jaxrl.trainers.registry import ALGORITHMS


def build(argv: list[str]) -> tuple[Any, dict, str]:
    opts, rest = split_bench_flags(argv)
    algo = "sft"
    for i, a in enumerate(rest):
        if a == "--algo":
            algo = rest[i + 1]
        elif a.startswith("--algo="):
            algo = a.split("=", 1)[1]
    if opts["preset"] is None:
        if algo == "forward":
            raise ValueError("--algo forward needs --preset NAME (e.g. qwen2.5-0.5b).")
        return build_trainer(rest), opts, algo
    rest = [a for i, a in enumerate(rest) if a != "--algo" and (i == 0 or rest[i - 1] != "--algo")]
    rest = [a for a in rest if not a.startswith("--algo=")]
    cfg_algo = "sft" if algo == "forward" else algo
    yaml_path = CONFIG_DIR / f"{ALGORITHMS[cfg_algo].recipe}.yaml"
    args, _ = parse_config(
        ALGORITHMS[cfg_algo].config_class,
        yaml_path=yaml_path if yaml_path.exists() else None,
        cli_args=rest,
        overrides={
            # Padding-free SFT takes no `max_length` (TRL); the rows are made at most T long.
            "max_length": None if _padding_free(rest) else opts["seq_len"],
            "disable_tqdm": True,
            "save_strategy": "no",
            "eval_strategy": "no",
        },
    )
    hf_config = presets.get_preset(opts["preset"])
    tok = SimpleNamespace(pad_token_id=0, pad_token="<pad>", eos_token="<eos>")
    cls = ALGORITHMS[cfg_algo].trainer_class
    trainer = cls(model=hf_config, args=args, processing_class=tok)
    trainer.seq_len = opts["seq_len"]
    if algo == "dpo" and args.prefix_sharing:  # one row holds the prompt and both completions
        trainer.seq_len += opts["seq_len"] - opts["seq_len"] // 2
    opts["vocab"] = hf_config.vocab_size
    if opts["lengths"] not in LENGTHS:
        raise ValueError(f"--lengths {opts['lengths']!r}: use one of {LENGTHS}.")
    if opts["lengths"] == "longtail":
        if algo not in ("sft", "dpo"):
            raise ValueError("--lengths longtail supports --algo sft and dpo.")
        # The trainer's own data path on already tokenized rows, trained in order (as the TRL
        # side's `train_sampling_strategy="sequential"`), static length and buckets from them.
        n = args.per_device_train_batch_size * trainer.dp * args.gradient_accumulation_steps
        n *= opts["warmup"] + opts["steps"]
        # Seed 0 for lengths and tokens, as `examples/bench_trl.py`: the same rows on both sides.
        lengths = long_tail_lengths(n, opts["seq_len"], seed=0)
        rows = synthetic_examples(algo, n, opts["seq_len"], opts["vocab"], 0, lengths)
        trainer.args.train_sampling_strategy = "sequential"
        trainer.train_dataset = datasets.Dataset.from_list(rows)
        trainer.seq_len = trainer._choose_seq_len()
        if algo == "dpo":  # the head's span follows the completions (SFT trains every token)
            trainer.score_span = trainer._score_span([trainer.train_dataset])
    return trainer, opts, algo


def _padding_free(argv: list[str]) -> bool:
    """Whether the training flags set `--padding_free true`."""
    value = split_flags(argv, {"--padding_free": str}, {})[0].get("padding_free", "false")
    return value.lower() in ("true", "1", "yes")


def run(argv: list[str]) -> dict:
    trainer, opts, algo = build(argv)
    if opts["lengths"] == "longtail":
        return _run_varying(trainer, opts, algo)
    a = trainer.args
    accum = a.gradient_accumulation_steps
    n = a.per_device_train_batch_size * trainer.dp * accum
    if opts["preset"] is None:
        examples, _ = next(iter(trainer._train_iterator()))
        host = trainer._collate_micro(examples, accum)
    else:
        ex = synthetic_examples(algo, n, opts["seq_len"], opts["vocab"], a.seed)
        if algo == "dpo":  # the head's span follows the data, as the trainer's datasets set it
            trainer.score_span = trainer._score_span([ex])
        host = trainer._collate_micro(ex, accum)
    model_config = trainer.model.config.hf_config
    state = trainer._build_state()
    trainer._compile(state)
    batch = trainer._to_device(host)
    if algo == "forward":
        loss_fn = trainer._loss_fn()
        mb = {k: v[0] for k, v in batch.items()}
        grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, state, mb, None, {})[0]))
        step = lambda s: (s, grad(s.params))  # noqa: E731
    else:
        step = lambda s: trainer._jit_train_step(s, batch)  # noqa: E731

    t0 = time.perf_counter()
    state, out = step(state)
    jax.block_until_ready(out)
    first_call_s = time.perf_counter() - t0
    for _ in range(opts["warmup"]):
        state, out = step(state)
    jax.block_until_ready(out)
    profile = opts["profile_dir"]
    if profile:
        jax.profiler.start_trace(profile, create_perfetto_trace=True)
    t0 = time.perf_counter()
    for _ in range(opts["steps"]):
        state, out = step(state)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / opts["steps"]
    if profile:
        jax.profiler.stop_trace()
    compile_s = max(first_call_s - step_s, 0.0)  # tracing + XLA compile of the first call

    # Tokens the model runs per step; `tokens` counts them as TRL does (a DPO prompt once per
    # completion), so tokens/s compares across layouts and with TRL; MFU uses what actually ran.
    computed = int(host["attention_mask"].sum()) * jax.process_count()
    tokens = computed
    if "branch_ids" in host:  # DPO prefix sharing: the prompt ran once for both completions
        tokens += int((host["branch_ids"] == 1).sum()) * jax.process_count()
    seq_len = host["input_ids"].shape[-1]
    # Training FLOPs: 6N per token (+ attention) for the policy; DPO adds the reference forward
    # (a third of that); forward-only is fwd+bwd = the same 6N without the optimizer.
    fpt = presets.flops_per_token(model_config, seq_len)
    flops = fpt * computed
    span = trainer.score_span  # SFT / DPO: the LM head's positions per row
    if span is not None:  # the LM head ran on `span` positions per row, not on every token
        head_pt = 6.0 * presets.head_params(model_config)
        rows = host["input_ids"].size // seq_len * jax.process_count()
        flops -= head_pt * (computed - rows * span)
    if algo == "dpo" and trainer.uses_ref_params:
        flops *= 4 / 3
    mfu = mfu_of(flops, step_s)
    return _step_result(
        trainer, opts, algo, step_s, compile_s, tokens, mfu,
        computed_tokens_per_step=computed, seq_len=seq_len, score_span=span, global_batch=n,
        scan_layers=trainer.scan_layers,
    )  # fmt: skip


def _step_result(
    trainer: Any,
    opts: dict,
    algo: str,
    step_s: float,
    compile_s: float,
    tokens_per_step: float,
    mfu: float | None,
    **extra: Any,
) -> dict:
    """The JSON fields every train-step bench result has (`extra` adds or overrides)."""
    devices = jax.devices()
    peak_bytes, peak_src = peak_memory()
    return {
        "algo": algo,
        "step_s": step_s,
        "tokens_per_sec": tokens_per_step / step_s,
        "steps_per_sec": 1 / step_s,
        "compile_s": compile_s,
        "peak_bytes": peak_bytes,
        "peak_bytes_source": peak_src,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mfu": mfu,
        "tokens_per_step": tokens_per_step,
        "preset": opts["preset"],
        "compute_dtype": jnp.dtype(trainer.compute_dtype).name,
        "prefix_sharing": getattr(trainer.args, "prefix_sharing", None),
        "steps": opts["steps"],
        **extra,
    }


def _run_varying(trainer: Any, opts: dict, algo: str) -> dict:
    """`run` over a dataset of varying lengths (`--lengths longtail`): each step is the
    trainer's own iteration on the next batch (host collation included, as TRL's timing
    includes its collator). Every row length the steps use is compiled first (`compile_s`)."""
    it = trainer._train_iterator()
    items = [next(it) for _ in range(opts["warmup"] + opts["steps"])]
    t0 = time.perf_counter()
    trainer._ensure_state()
    shapes = {}
    for item in items:
        seq_len = trainer._batch_seq_len(trainer.train_dataset, item[1], "train")
        if seq_len not in shapes:
            shapes[seq_len] = trainer._train_iteration(item)
    jax.block_until_ready(trainer.train_state)
    compile_s = time.perf_counter() - t0
    for item in items[: opts["warmup"]]:
        trainer._train_iteration(item)
    jax.block_until_ready(trainer.train_state)
    t0 = time.perf_counter()
    for item in items[opts["warmup"] :]:
        trainer._train_iteration(item)
    jax.block_until_ready(trainer.train_state)
    step_s = (time.perf_counter() - t0) / opts["steps"]
    ds = trainer.train_dataset
    timed = np.concatenate([item[1] for item in items[opts["warmup"] :]]).tolist()
    if algo == "sft":
        tokens = sum(len(ds[i]["input_ids"]) for i in timed)
    else:  # TRL's count: the prompt once per completion
        tokens = sum(
            2 * len(ds[i]["prompt_input_ids"])
            + len(ds[i]["chosen_input_ids"])
            + len(ds[i]["rejected_input_ids"])
            for i in timed
        )
    steps_at = [trainer._batch_seq_len(ds, item[1], "train") for item in items[opts["warmup"] :]]
    buckets = trainer.length_buckets
    if algo == "sft" and trainer._padding_free("train"):  # lengths of flattened device rows
        buckets = trainer._padding_free_buckets("train")
    return _step_result(
        trainer, opts, algo, step_s, compile_s, tokens / opts["steps"], None,
        seq_len=trainer.seq_len, length_buckets=list(buckets),
        row_lengths_per_step=steps_at, lengths=opts["lengths"], score_span=trainer.score_span,
        global_batch=trainer.train_batch_size,
    )  # fmt: skip
