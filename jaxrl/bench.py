"""`python -m jaxrl.bench --algo {forward,sft,reward,dpo,generate,ppo,grpo,ddpo} [flags]`.

Runs the real jitted train step of the chosen algorithm: a few warm-up steps, then timed steps,
and prints as its last line one JSON object with `algo, step_s, tokens_per_sec, compile_s,
peak_bytes, devices, mfu` (and more). Without `--preset` it benchmarks exactly what
`python -m jaxrl.train --algo ALGO` would train (same flags, real data); with
`--preset NAME --seq_len T` it uses a random-weight model of that shape and synthetic token
data of length T (no download needed). `--algo forward` times forward+backward of the LM loss
only (no optimizer update).

Bench flags: --preset NAME, --seq_len T, --steps N (default 10), --warmup N (default 2),
--profile_dir DIR (a `jax.profiler` trace of the timed steps, with a Perfetto JSON;
`examples/trace_top.py DIR` sums its device ops), --lengths {fixed,longtail} (with --preset, sft
and dpo: every row T tokens, the default, or a long-tailed length distribution capped at T,
`long_tail_lengths`, as real chat data has: then each step trains on its own batch of a
synthetic dataset in order, every `length_buckets` shape is compiled before the timing, and
`compile_s` is their total).
Everything else is a training-config flag, as for `jaxrl.train`.

`--algo generate` times `jaxrl.generation.Sampler` against transformers `generate` (PyTorch on
CPU) on the same random model, prompts and sampling settings (TRL's GRPO defaults: temperature
1, no top-k/top-p, no EOS so every row generates all tokens), and reports both and their ratio.
Its flags: --preset NAME (default: a 4-layer, 256-wide Llama), --batch B (32), --prompt_len P
(32), --max_new_tokens N (64), --steps (3), --warmup (1), --torch_threads (PyTorch's default).
One step = one whole `generate` call (prefill + N decode steps); tokens = generated tokens. The
timed calls alternate jaxrl, transformers, jaxrl, ... so both sides run under the same load.

`--compare trl [--sweep] [--reps N]` (sft, dpo): times jaxrl against TRL's trainer
(`examples/bench_trl.py`, torch on this machine) at the `--preset/--seq_len/
--per_device_train_batch_size[/--lengths]` point, or with `--sweep` at every point of `SWEEP`.
With `--lengths longtail` both sides train on the same rows in the same order, and jaxrl also
runs with `--length_buckets null` (one static length, its behaviour before buckets): a row
labelled `static`; and both sides run `padding_free=True` (`max_length=None`): a row labelled
`padding_free`, against TRL's padding-free run. A rep runs each label's jaxrl child, then the TRL child once (the labels of
a point share it). Each side runs
in its own child process, alternating jaxrl, TRL, jaxrl, ... `--reps` times (default 3); a line
per point gives the median step times, the ratio (TRL step / jaxrl step: > 1 means jaxrl is
faster) and each side's peak RSS. DPO runs TRL's objective and layout on both sides (sigmoid
loss, two rows per pair, f32); jaxrl's prefix-sharing layout is a separate row labelled
`prefix_sharing`.

`--algo ppo` times one PPO iteration of `PPOTrainer` (generate, score, `step()`'s forward pass
and update) against TRL v0.7.2's PPOTrainer in one run: it first runs
`examples/bench_ppo_trl072.py` with the old-TRL interpreter (`--trl_python`, default
`/work/.peer-trl072/bin/python`), which builds and saves the tiny random GPT-2 both sides use,
then the same loop in jaxrl. Flags: --batch (32), --mini_batch (8), --ppo_epochs (4),
--prompt_len (16), --max_new_tokens (16), --steps (3), --torch_threads (TRL side; 0: PyTorch's
default), --trl_python.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import _malloc

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices (e.g. CPU) report mfu=null.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}
_BENCH_FLAGS = {
    "--preset": str,
    "--seq_len": int,
    "--steps": int,
    "--warmup": int,
    "--profile_dir": str,  # a jax.profiler trace (and Perfetto JSON) of the timed steps
    "--lengths": str,  # "fixed" (every row --seq_len tokens) or "longtail" (capped at it)
}
LENGTHS = ("fixed", "longtail")


def peak_flops(device) -> float | None:
    kind = device.device_kind
    for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return flops
    return None


def split_flags(
    argv: list[str], types: dict[str, Any], defaults: dict[str, Any]
) -> tuple[dict, list[str]]:
    """Pull the bench's own `--flag value` / `--flag=value` options (`types`: flag -> parser) out
    of `argv`; the rest goes on to the config parser."""
    opts = dict(defaults)
    rest, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in types:
            if "=" in argv[i]:
                value, i = argv[i].split("=", 1)[1], i + 1
            else:
                value, i = argv[i + 1], i + 2
            opts[flag[2:]] = types[flag](value)
        else:
            rest.append(argv[i])
            i += 1
    return opts, rest


def _split_bench_flags(argv: list[str]) -> tuple[dict, list[str]]:
    return split_flags(
        argv,
        _BENCH_FLAGS,
        {
            "preset": None,
            "seq_len": 512,
            "steps": 10,
            "warmup": 2,
            "profile_dir": None,
            "lengths": "fixed",
        },
    )


def long_tail_lengths(n: int, max_len: int, seed: int = 0, min_len: int = 8) -> list[int]:
    """`n` row lengths of a long-tailed distribution capped at `max_len`, shaped like chat SFT
    data: log-normal with median `max_len / 6` and sigma 0.75 (mean about `max_len / 4.5`,
    about 1% cut at the cap), at least `min_len`, and one row at the cap so that a run's
    static length is `max_len`, as for a real dataset cut at `max_length`."""
    rng = np.random.default_rng([seed, 7])
    x = np.exp(rng.normal(np.log(max_len / 6), 0.75, n))
    lengths = np.clip(np.round(x), min_len, max_len).astype(int)
    lengths[rng.integers(n)] = max_len
    return lengths.tolist()


def _synthetic_examples(
    algo: str, n: int, seq_len: int, vocab: int, seed: int, lengths: list[int] | None = None
) -> list[dict]:
    """Token data of exactly `seq_len` per row, or of `lengths[i]` for row i (DPO/reward: half
    prompt, half completion; with DPO prefix sharing a row holds the prompt and both
    completions)."""
    rng = np.random.default_rng(seed)
    lengths = lengths or [seq_len] * n

    def ids(length):
        return rng.integers(3, vocab, size=length).tolist()

    if algo in ("sft", "forward"):
        return [{"input_ids": ids(length)} for length in lengths]
    if algo == "dpo":
        return [
            {
                "prompt_input_ids": ids(length // 2),
                "chosen_input_ids": ids(length - length // 2),
                "rejected_input_ids": ids(length - length // 2),
            }
            for length in lengths
        ]
    return [
        {"chosen_input_ids": ids(seq_len), "rejected_input_ids": ids(seq_len)} for _ in range(n)
    ]


def _peak_bytes() -> tuple[int, str]:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


def _algo(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--algo" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--algo="):
            return a.split("=", 1)[1]
    return None


def build(argv: list[str]) -> tuple[Any, dict, str]:
    from jaxrl import trainers
    from jaxrl.config import CONFIGS, parse_config
    from jaxrl.models import presets
    from jaxrl.train import CONFIG_DIR, build_trainer

    opts, rest = _split_bench_flags(argv)
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
    yaml_path = CONFIG_DIR / f"{cfg_algo}.yaml"
    args, _ = parse_config(
        CONFIGS[cfg_algo],
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
    cls = {
        "sft": trainers.SFTTrainer,
        "forward": trainers.SFTTrainer,
        "reward": trainers.RewardTrainer,
        "dpo": trainers.DPOTrainer,
    }[algo]
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
        import datasets

        # The trainer's own data path on already tokenized rows, trained in order (as the TRL
        # side's `train_sampling_strategy="sequential"`), static length and buckets from them.
        n = args.per_device_train_batch_size * trainer.dp * args.gradient_accumulation_steps
        n *= opts["warmup"] + opts["steps"]
        # Seed 0 for lengths and tokens, as `examples/bench_trl.py`: the same rows on both sides.
        lengths = long_tail_lengths(n, opts["seq_len"], seed=0)
        rows = _synthetic_examples(algo, n, opts["seq_len"], opts["vocab"], 0, lengths)
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
    from jaxrl.models import presets

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
        ex = _synthetic_examples(algo, n, opts["seq_len"], opts["vocab"], a.seed)
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
    devices = jax.devices()
    peak = peak_flops(devices[0])
    mfu = (flops / step_s / (peak * len(devices))) if peak else None
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
    peak_bytes, peak_src = _peak_bytes()
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


# ---------------------------------------------------------------- LoRA vs full vs TRL + PEFT

_LORA_FLAGS = {
    "--use_peft": str,
    "--lora_r": int,
    "--lora_alpha": float,
    "--lora_target_modules": str,
    "--seq_len": int,
    "--steps": int,
    "--warmup": int,
    "--per_device_train_batch_size": int,
    "--hidden_size": int,
    "--num_hidden_layers": int,
    "--lora_case": str,
    "--model_dir": str,
}
LORA_CASES = ("jaxrl_full", "jaxrl_lora", "jaxrl_qlora_nf4", "trl_full", "trl_peft")


def _lora_opts(argv: list[str]) -> dict:
    opts = {
        "lora_r": 16,
        "lora_alpha": 32.0,
        "lora_target_modules": "all-linear",
        "seq_len": 256,
        "steps": 5,
        "warmup": 2,
        "per_device_train_batch_size": 4,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "lora_case": None,
        "model_dir": None,
    }
    i = 0
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        if flag == "--algo":
            value = value or argv[i + 1]
            if value != "sft":
                raise ValueError("--use_peft true benchmarks --algo sft only.")
        elif flag not in _LORA_FLAGS:
            raise ValueError(
                f"--use_peft true: unknown flag {flag} (known: {sorted(_LORA_FLAGS)})."
            )
        else:
            opts[flag[2:]] = _LORA_FLAGS[flag](value or argv[i + 1])
        i += 1 if value and "=" in argv[i] else 2
    return opts


def _tiny_lora_model(path: str, opts: dict) -> None:
    """A random Qwen2 of the requested width/depth, saved by transformers (both sides load it)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from jaxrl.data import task

    h = opts["hidden_size"]
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=opts["num_hidden_layers"],
        num_attention_heads=max(h // 64, 1),
        num_key_value_heads=max(h // 128, 1),
        max_position_embeddings=max(2 * opts["seq_len"], 512),
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    task.load_tokenizer().save_pretrained(path)


def _nbytes(tree: Any) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def _jaxrl_lora_case(case: str, opts: dict) -> dict:
    from transformers import AutoTokenizer

    from jaxrl import lora
    from jaxrl.config import SFTConfig
    from jaxrl.trainers import SFTTrainer

    args = SFTConfig(
        output_dir=f"{opts['model_dir']}/jaxrl_{case}",
        max_steps=opts["steps"] + opts["warmup"],
        per_device_train_batch_size=opts["per_device_train_batch_size"],
        mesh_data=1,
        mesh_fsdp=1,
        mesh_tensor=1,
        max_length=opts["seq_len"],
        learning_rate=1e-4,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
    )
    peft = None
    if case != "jaxrl_full":
        peft = lora.LoraConfig(
            r=opts["lora_r"],
            lora_alpha=opts["lora_alpha"],
            target_modules=opts["lora_target_modules"],
        )
    quant_cfg = "nf4" if case == "jaxrl_qlora_nf4" else None
    tok = AutoTokenizer.from_pretrained(opts["model_dir"])
    trainer = SFTTrainer(
        opts["model_dir"],
        args,
        processing_class=tok,
        peft_config=peft,
        quantization_config=quant_cfg,
    )
    trainer.seq_len = opts["seq_len"]
    n = opts["per_device_train_batch_size"]
    ex = _synthetic_examples("sft", n, opts["seq_len"], 1024, 0)
    host = trainer._collate_micro(ex, 1)
    state = trainer._build_state()
    trainer._compile(state)
    batch = trainer._to_device(host)
    sizes = {
        "trainable_bytes": _nbytes(state.params),
        "optimizer_bytes": _nbytes(state.opt_state),
        "frozen_bytes": _nbytes(state.frozen),
    }
    t0 = time.perf_counter()
    for _ in range(opts["warmup"]):
        state, out = trainer._jit_train_step(state, batch)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(opts["steps"]):
        state, out = trainer._jit_train_step(state, batch)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / opts["steps"]
    peak, src = _peak_bytes()
    return {"step_s": step_s, "warmup_s": first_s, "peak_bytes": peak, "peak_source": src, **sizes}


def _trl_lora_case(case: str, opts: dict) -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    torch.manual_seed(0)
    n = opts["per_device_train_batch_size"] * (opts["steps"] + opts["warmup"])
    rows = _synthetic_examples("sft", n, opts["seq_len"], 1024, 0)
    args = trl.SFTConfig(
        output_dir=f"{opts['model_dir']}/trl_{case}",
        per_device_train_batch_size=opts["per_device_train_batch_size"],
        max_steps=opts["steps"] + opts["warmup"],
        max_length=opts["seq_len"],
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        dataloader_num_workers=0,
    )
    peft_config = None
    if case == "trl_peft":
        import peft

        peft_config = peft.LoraConfig(
            r=opts["lora_r"],
            lora_alpha=opts["lora_alpha"],
            target_modules=opts["lora_target_modules"],
            task_type="CAUSAL_LM",
        )
    timer = StepTimer()
    trainer = trl.SFTTrainer(
        opts["model_dir"],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(opts["model_dir"]),
        peft_config=peft_config,
        callbacks=[timer],
    )
    trainer.train()
    step_s = float(np.mean(timer.times[opts["warmup"] :]))
    if torch.cuda.is_available():
        peak, src = int(torch.cuda.max_memory_allocated()), "device"
    else:
        peak, src = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"
    trainable = sum(
        p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad
    )
    return {"step_s": step_s, "peak_bytes": peak, "peak_source": src, "trainable_bytes": trainable}


def run_lora(argv: list[str]) -> dict:
    """`--algo sft --use_peft true`: SFT step time and memory of jaxrl full fine-tuning, LoRA and
    QLoRA (NF4 base) against TRL full and TRL + PEFT LoRA on the same random tiny Qwen2 and the
    same token batches. Each case runs in its own process, so peak memory is per case."""
    import os
    import subprocess
    import tempfile

    opts = _lora_opts(argv)
    if opts["lora_case"] is not None:  # one case, in a child process
        fn = _trl_lora_case if opts["lora_case"].startswith("trl") else _jaxrl_lora_case
        return fn(opts["lora_case"], opts)
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_lora_model(tmp, opts)
        results: dict[str, Any] = {
            "algo": "sft",
            "use_peft": True,
            "load_avg_1m": os.getloadavg()[0],
            "device": jax.devices()[0].device_kind,
            **{k: v for k, v in opts.items() if k not in ("lora_case", "model_dir", "use_peft")},
        }
        for case in LORA_CASES:
            cmd = [
                sys.executable,
                "-m",
                "jaxrl.bench",
                *argv,
                "--lora_case",
                case,
                "--model_dir",
                tmp,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{case} failed:\n{proc.stderr[-3000:]}")
            results[case] = json.loads(proc.stdout.strip().splitlines()[-1])
        results["load_avg_1m_end"] = os.getloadavg()[0]
    return results


def _generate_bench_model() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )


def _generate_flags(argv: list[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxrl.bench --algo generate")
    parser.add_argument("--algo", choices=["generate"], required=True)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--torch_threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="weights and activations on both sides (transformers runs on CUDA when it can)",
    )  # fmt: skip
    return parser.parse_args(argv)


def _timed(fn: Any, steps: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of each call (CPU time is what a loaded, shared
    machine perturbs least)."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def run_generate(argv: list[str]) -> dict:
    """Sampler vs transformers `generate` on one random model (see the module docstring)."""
    import os
    import tempfile

    import torch
    import transformers

    from jaxrl import models
    from jaxrl.generation import GenerationConfig, Sampler
    from jaxrl.models import presets

    flags = _generate_flags(argv)
    if flags.torch_threads:
        torch.set_num_threads(flags.torch_threads)
    hf_config = (
        _generate_bench_model() if flags.preset is None else presets.get_preset(flags.preset)
    )
    hf_config.eos_token_id = None  # every row generates max_new_tokens on both sides
    torch.manual_seed(flags.seed)
    torch_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        torch_model.save_pretrained(tmp)
        model = models.from_pretrained(tmp, dtype=flags.dtype, param_dtype=flags.dtype)
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_model = torch_model.to(torch_device, getattr(torch, flags.dtype))
    batch, prompt_len, n_new = flags.batch, flags.prompt_len, flags.max_new_tokens
    ids = np.random.default_rng(flags.seed).integers(3, hf_config.vocab_size, (batch, prompt_len))
    gen = GenerationConfig(max_new_tokens=n_new, do_sample=True, top_k=0, top_p=1.0)
    sampler = Sampler(model, prompt_buckets=(prompt_len,))
    seeds = iter(range(1 << 30))

    def jax_generate() -> None:
        jax.block_until_ready(sampler(None, ids, gen, seed=next(seeds)))

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    jax_generate()
    first_call_s = time.perf_counter() - t0
    _timed(jax_generate, flags.warmup)

    torch_ids = torch.from_numpy(ids).to(torch_device)
    hf_kwargs = dict(
        input_ids=torch_ids,
        attention_mask=torch.ones_like(torch_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )

    def hf_generate(max_new_tokens: int = n_new) -> None:
        with torch.no_grad():
            torch_model.generate(**hf_kwargs, max_new_tokens=max_new_tokens)
        if torch_device == "cuda":
            torch.cuda.synchronize()

    hf_generate(2)  # first-call setup outside the timing, as for jaxrl's compile
    # Alternate the two sides call by call so both see the same load on this shared machine.
    jax_times, jax_cpu, hf_times, hf_cpu, loads = [], [], [], [], []
    for _ in range(flags.steps):
        for fn, wall, cpu in ((jax_generate, jax_times, jax_cpu), (hf_generate, hf_times, hf_cpu)):
            (w,), (c,) = _timed(fn, 1)
            wall.append(w)
            cpu.append(c)
        loads.append(os.getloadavg()[0])
    load_after = os.getloadavg()[0]

    step_s, hf_step_s = float(np.median(jax_times)), float(np.median(hf_times))
    tokens = batch * n_new
    devices = jax.devices()
    peak = peak_flops(devices[0])
    # Forward FLOPs of every token run (prompt + generated), attention at the mean context.
    fwd_flops = presets.flops_per_token(hf_config, prompt_len + n_new // 2) / 3
    mfu = (
        fwd_flops * batch * (prompt_len + n_new) / step_s / (peak * len(devices)) if peak else None
    )
    peak_bytes, peak_src = _peak_bytes()
    return {
        "algo": "generate",
        "step_s": step_s,
        "tokens_per_sec": tokens / step_s,
        "compile_s": max(first_call_s - step_s, 0.0),
        "peak_bytes": peak_bytes,
        "peak_bytes_source": peak_src,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mfu": mfu,
        "step_s_all": jax_times,
        "cpu_s": float(np.median(jax_cpu)),
        "cpu_s_all": jax_cpu,
        "transformers_step_s": hf_step_s,
        "transformers_step_s_all": hf_times,
        "transformers_cpu_s": float(np.median(hf_cpu)),
        "transformers_cpu_s_all": hf_cpu,
        "transformers_tokens_per_sec": tokens / hf_step_s,
        "speedup_vs_transformers": hf_step_s / step_s,
        "cpu_time_ratio_vs_transformers": float(np.median(hf_cpu) / np.median(jax_cpu)),
        "torch_threads": torch.get_num_threads(),
        "load_avg_before_after": [load_before, load_after],
        "load_avg_per_round": loads,
        "cpu_count": os.cpu_count(),
        "batch": batch,
        "prompt_len": prompt_len,
        "max_new_tokens": n_new,
        "dtype": flags.dtype,
        "transformers_device": torch_device,
        "tokens_per_step": tokens,
        "preset": flags.preset,
        "steps": flags.steps,
    }


# ---------------------------------------------------------------- jaxrl vs TRL (--compare trl)

# (preset, batch, seq_len): the shapes of issue 14's table. DPO batches count pairs.
SWEEP = (
    ("llama-4x256", 8, 128),
    ("llama-4x256", 8, 256),
    ("llama-4x256", 8, 512),
    ("llama-4x256", 8, 1024),
    ("llama-4x256", 32, 256),
    ("llama-8x512", 8, 512),
)
_COMPARE_FLAGS = {"--compare": str, "--sweep": None, "--reps": int}


def _split_compare_flags(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict[str, Any] = {"compare": None, "sweep": False, "reps": 3}
    rest, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in _COMPARE_FLAGS:
            rest.append(argv[i])
            i += 1
        elif _COMPARE_FLAGS[flag] is None:
            opts[flag[2:]], i = True, i + 1
        elif "=" in argv[i]:
            opts[flag[2:]], i = _COMPARE_FLAGS[flag](argv[i].split("=", 1)[1]), i + 1
        else:
            opts[flag[2:]], i = _COMPARE_FLAGS[flag](argv[i + 1]), i + 2
    return opts, rest


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run one benchmark process; its last stdout line (JSON) plus its own peak RSS."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        stderr = proc.stderr.read()  # until the child exits; stdout goes to a file
        # wait4 reports this child's own resource usage (ru_maxrss in KiB on Linux).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024
    return result


def compare_commands(
    algo: str,
    point: tuple[str, int, int],
    steps: int,
    warmup: int,
    extra: list[str],
    lengths: str = "fixed",
) -> dict[str, tuple[list[str], list[str]]]:
    """label -> (jaxrl command, TRL command) for one sweep point."""
    preset, batch, seq_len = point
    common = ["--steps", str(steps), "--warmup", str(warmup), "--lengths", lengths]
    jaxrl = [sys.executable, "-m", "jaxrl.bench", "--algo", algo, "--preset", preset]
    jaxrl += ["--seq_len", str(seq_len), "--per_device_train_batch_size", str(batch), *common]
    jaxrl += ["--bf16", "false", "--gradient_checkpointing", "false"]
    script = Path(__file__).resolve().parents[1] / "examples" / "bench_trl.py"
    if not script.exists():
        raise ValueError(f"--compare trl runs {script}, which is missing (use a source checkout).")
    trl = [sys.executable, str(script), "--algo", algo, "--preset", preset]
    trl += ["--seq_len", str(seq_len), "--batch", str(batch), *common]
    # Precision and rematerialisation follow the jaxrl flags on both sides (f32, none by default).
    shared = split_flags(extra, {"--bf16": str, "--gradient_checkpointing": str}, {})[0]
    trl += [f"--{name}" for name, value in shared.items() if value.lower() == "true"]
    # Varying lengths: also jaxrl with one static row length (before `length_buckets`).
    static = ["--length_buckets", "null"]
    if algo == "sft":
        out = {"sft": (jaxrl + extra, trl)}
        if lengths != "fixed":
            out["sft static"] = (jaxrl + static + extra, trl)
            # Both sides padding-free (TRL: one flattened row per device, `max_length=None`).
            pf = ["--padding_free", "true"]
            out["sft padding_free"] = (jaxrl + pf + extra, trl + ["--padding_free"])
        return out
    # TRL's objective and layout: sigmoid loss only, prompt + completion rows per pair.
    dpo = ["--loss_type", "sigmoid", "--loss_weights", "null"]
    dpo += ["--max_prompt_length", str(seq_len // 2)]
    out = {
        "dpo": (jaxrl + dpo + ["--prefix_sharing", "false"] + extra, trl),
        "dpo prefix_sharing": (jaxrl + dpo + ["--prefix_sharing", "true"] + extra, trl),
    }
    if lengths != "fixed":
        out["dpo static"] = (jaxrl + dpo + ["--prefix_sharing", "false"] + static + extra, trl)
    return out


def _trl_env() -> dict[str, str]:
    """The TRL child's environment: the user's, without jaxrl's malloc tunable (TRL runs as its
    users run it), and with this checkout on `PYTHONPATH`: `examples/bench_trl.py` imports jaxrl,
    which a source checkout run as `python -m jaxrl.bench` has not installed."""
    env = _malloc.without_reexec(dict(os.environ))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def compare(argv: list[str]) -> list[dict]:
    """jaxrl vs TRL, interleaved per point (see the module docstring); prints a line per point."""
    copts, rest = _split_compare_flags(argv)
    if copts["compare"] != "trl":
        raise ValueError(f"--compare {copts['compare']!r}: only `--compare trl` is supported.")
    opts, rest = _split_bench_flags(rest)
    algo, extra, i = "sft", [], 0
    batch = 8
    while i < len(rest):
        flag, _, value = rest[i].partition("=")
        if not value and flag in ("--algo", "--per_device_train_batch_size"):
            value, i = rest[i + 1], i + 1
        if flag == "--algo":
            algo = value
        elif flag == "--per_device_train_batch_size":
            batch = int(value)
        else:
            extra.append(rest[i])
        i += 1
    if algo not in ("sft", "dpo"):
        raise ValueError(f"--compare trl supports --algo sft and dpo, not {algo!r}.")
    if copts["sweep"]:
        points = SWEEP
    elif opts["preset"] is None:
        raise ValueError("--compare trl needs --sweep or --preset NAME [--seq_len T].")
    else:
        points = ((opts["preset"], batch, opts["seq_len"]),)
    results = []
    for point in points:
        commands = compare_commands(
            algo, point, opts["steps"], opts["warmup"], extra, opts["lengths"]
        )
        # One rep runs every label's jaxrl command, then each distinct TRL command once (the
        # labels are jaxrl variants against the same TRL run), so all of them see the same load.
        trl_cmds = list(dict.fromkeys(tuple(trl) for _, trl in commands.values()))
        jaxrl_runs: dict[str, list[dict]] = {label: [] for label in commands}
        trl_runs: dict[tuple, list[dict]] = {cmd: [] for cmd in trl_cmds}
        loads = []
        for _ in range(copts["reps"]):
            loads.append(os.getloadavg()[0])
            for label, (jaxrl_cmd, _) in commands.items():
                jaxrl_runs[label].append(run_child(jaxrl_cmd))
            for cmd in trl_cmds:
                trl_runs[cmd].append(run_child(list(cmd), _trl_env()))
        for label, (_, trl_cmd) in commands.items():
            runs = {"jaxrl": jaxrl_runs[label], "trl": trl_runs[tuple(trl_cmd)]}
            step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
            rss = {k: max(r["peak_rss_bytes"] for r in v) for k, v in runs.items()}
            row = {
                "algo": label,
                "preset": point[0],
                "batch": point[1],
                "seq_len": point[2],
                "lengths": opts["lengths"],
                "jaxrl_step_s": step["jaxrl"],
                "trl_step_s": step["trl"],
                "speed_ratio": step["trl"] / step["jaxrl"],
                "jaxrl_step_s_all": [r["step_s"] for r in runs["jaxrl"]],
                "trl_step_s_all": [r["step_s"] for r in runs["trl"]],
                "jaxrl_peak_rss_bytes": rss["jaxrl"],
                "trl_peak_rss_bytes": rss["trl"],
                "load_avg_1m": loads,
                "reps": copts["reps"],
                "jaxrl_runs": runs["jaxrl"],  # each child's own JSON (tokens/s, mfu, memory)
                "trl_runs": runs["trl"],
            }
            print(
                f"{label:20s} {point[0]} B={point[1]:<3d} T={point[2]:<5d} "
                f"jaxrl {step['jaxrl']:.4f}s  TRL {step['trl']:.4f}s  "
                f"jaxrl/TRL speed {row['speed_ratio']:.2f}x  peak RSS jaxrl "
                f"{rss['jaxrl'] / 2**30:.2f} GiB, TRL {rss['trl'] / 2**30:.2f} GiB  "
                f"(load {min(loads):.1f}-{max(loads):.1f})",
                flush=True,
            )
            results.append(row)
    return results


def run_ppo(argv: list[str]) -> dict:
    """jaxrl's PPOTrainer vs TRL v0.7.2's on one tiny model (see the module docstring)."""
    import argparse
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from jaxrl.trainers.ppo import PPOTrainer
    from jaxrl.trainers.ppo_config import PPOConfig

    parser = argparse.ArgumentParser(prog="python -m jaxrl.bench --algo ppo")
    parser.add_argument("--algo", choices=["ppo"], required=True)
    for name, default in (
        ("batch", 32), ("mini_batch", 8), ("ppo_epochs", 4), ("prompt_len", 16),
        ("max_new_tokens", 16), ("steps", 3), ("seed", 0), ("torch_threads", 0),
    ):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--trl_python", default="/work/.peer-trl072/bin/python")
    f = parser.parse_args(argv)
    sizes = ["--batch", f.batch, "--mini_batch", f.mini_batch, "--ppo_epochs", f.ppo_epochs,
             "--prompt_len", f.prompt_len, "--max_new_tokens", f.max_new_tokens,
             "--steps", f.steps, "--seed", f.seed, "--torch_threads", f.torch_threads]  # fmt: skip
    script = Path(__file__).resolve().parent.parent / "examples" / "bench_ppo_trl072.py"
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [f.trl_python, str(script), "--out", tmp, *map(str, sizes)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode:
            raise ValueError(f"The TRL v0.7.2 side failed:\n{proc.stderr[-2000:]}")
        trl = json.loads(proc.stdout.strip().splitlines()[-1])
        config = PPOConfig(
            batch_size=f.batch, mini_batch_size=f.mini_batch, ppo_epochs=f.ppo_epochs,
            learning_rate=1.41e-5, seed=f.seed, output_dir=tmp,
        )  # fmt: skip
        trainer = PPOTrainer(config, os.path.join(tmp, "model"))
    vocab = trainer.model.config.vocab_size
    rng = np.random.default_rng(f.seed)
    gen_kwargs = dict(
        min_length=-1, top_k=0.0, top_p=1.0, do_sample=True, pad_token_id=0,
        max_new_tokens=f.max_new_tokens, min_new_tokens=f.max_new_tokens,
    )  # fmt: skip
    rows: dict[str, list[float]] = {
        k: [] for k in ("generate", "score", "forward_pass", "update", "step", "total")
    }
    for step in range(f.steps + 1):  # step 0: compile
        queries = list(rng.integers(1, vocab, (f.batch, f.prompt_len)))
        t0 = time.perf_counter()
        responses = trainer.generate(queries, batch_size=f.batch, return_prompt=False, **gen_kwargs)
        t1 = time.perf_counter()
        scores = [np.float32(np.mean(r % 2 == 0)) for r in responses]  # as the TRL script
        t2 = time.perf_counter()
        stats = trainer.step(queries, responses, scores)
        t3 = time.perf_counter()
        if step == 0:
            continue
        rows["generate"].append(t1 - t0)
        rows["score"].append(t2 - t1)
        rows["forward_pass"].append(stats["time/ppo/forward_pass"])
        rows["update"].append(stats["time/ppo/total"] - stats["time/ppo/forward_pass"])
        rows["step"].append(t3 - t2)
        rows["total"].append(t3 - t0)
    ours = {k: float(np.median(v)) for k, v in rows.items()}
    return {
        "algo": "ppo",
        "jaxrl_s": ours,
        "trl072_s": {k: trl[k] for k in ours},
        "speedup_vs_trl072": {k: trl[k] / max(ours[k], 1e-9) for k in ours},
        "trl_torch_threads": trl["torch_threads"],
        "load_avg_before_after": [load_before, os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "model": "GPT-2, 2 layers, 128 wide, 4 heads, vocab 64 (random, value head)",
        "batch": f.batch,
        "mini_batch": f.mini_batch,
        "ppo_epochs": f.ppo_epochs,
        "prompt_len": f.prompt_len,
        "max_new_tokens": f.max_new_tokens,
        "steps": f.steps,
    }


def _without_algo(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--algo":
            skip = True
        elif not a.startswith("--algo="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.split("=", 1)[0] == "--compare" for a in argv):
        try:
            rows = compare(argv)
        except ValueError as e:
            print(f"jaxrl.bench: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rows))
        return 0
    try:
        algo = _algo(argv)
        if _peft_on(argv):
            result = run_lora(argv)
        elif algo == "generate":
            result = run_generate(argv)
        elif algo == "grpo":
            from jaxrl.bench_grpo import run as run_grpo  # jaxrl vs TRL GRPOTrainer

            result = run_grpo(argv)
        elif algo == "ppo":
            result = run_ppo(argv)
        elif algo == "ddpo":
            result = run_ddpo(_without_algo(argv))
        else:
            result = run(argv)
    except ValueError as e:
        print(f"jaxrl.bench: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def run_ddpo(argv: list[str]) -> dict:
    """`--algo ddpo`: DDPO on the tiny SD pipeline vs TRL v0.7.2 on the same directory.

    Flags: --sample_num_steps (4), --batch (4), --repeats (3), --trl_python (path; TRL side
    skipped when empty). Times one sampling batch (images/s) and, from a whole DDPO epoch minus
    its sampling, the update (one optimizer update per epoch: train_batch_size = batch), with
    the same measurement on both sides; prints the machine's load average with the numbers.
    """
    import os
    import subprocess
    from pathlib import Path

    from jaxrl.models.diffusion import jpeg_compressibility
    from jaxrl.models.diffusion.tiny import tiny_pipeline
    from jaxrl.trainers.ddpo import DDPOTrainer
    from jaxrl.trainers.ddpo_config import DDPOConfig

    opts = {"sample_num_steps": "4", "batch": "4", "repeats": "3", "trl_python": ""}
    for i in range(0, len(argv), 2):
        key = argv[i].removeprefix("--")
        if key not in opts or i + 1 >= len(argv):
            raise ValueError(f"--algo ddpo: unknown or incomplete flag {argv[i]!r}; use {opts}.")
        opts[key] = argv[i + 1]
    steps, batch, repeats = int(opts["sample_num_steps"]), int(opts["batch"]), int(opts["repeats"])
    path = tiny_pipeline()
    cfg = DDPOConfig(
        sample_num_steps=steps,
        sample_batch_size=batch,
        train_batch_size=batch,
        sample_num_batches_per_epoch=1,
        mixed_precision="no",
        logdir="/tmp/jaxrl_ddpo_bench",
        save_freq=10**6,  # as the TRL side: no per-epoch image files inside the timed update
    )
    prompts = ["a photo of a cat", "a photo of a dog"]
    rng = np.random.default_rng(0)
    trainer = DDPOTrainer(cfg, jpeg_compressibility, lambda: (str(rng.choice(prompts)), {}), path)
    trainer._ensure_state()
    key = jax.random.key(0)

    def sample():
        s, _, _ = trainer._generate_samples(1, batch, key)
        jax.block_until_ready(s)

    t0 = time.perf_counter()
    sample()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeats):
        sample()
    sample_s = (time.perf_counter() - t0) / repeats
    jax.block_until_ready(trainer.step(0, 0))  # compile the update
    t0 = time.perf_counter()
    for i in range(repeats):
        jax.block_until_ready(trainer.step(i + 1, 0))
    update_s = max((time.perf_counter() - t0) / repeats - sample_s, 0.0)
    result = {
        "algo": "ddpo",
        "images_per_s": batch / sample_s,
        "update_s": update_s,
        "sample_compile_s": compile_s,
        "sample_num_steps": steps,
        "batch": batch,
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "device_kind": jax.devices()[0].device_kind,
    }
    if opts["trl_python"]:
        script = Path(__file__).resolve().parent.parent / "examples" / "bench_ddpo_trl072.py"
        out = subprocess.run(
            [opts["trl_python"], str(script), str(path), str(steps), str(batch), str(repeats)],
            capture_output=True,
            text=True,
            check=True,
        )
        trl = json.loads(out.stdout.strip().splitlines()[-1])
        result["trl_images_per_s"] = trl["images_per_s"]
        result["trl_update_s"] = trl["update_s"]
        result["sampling_speedup"] = result["images_per_s"] / trl["images_per_s"]
        result["update_speedup"] = trl["update_s"] / max(update_s, 1e-9)
        result["load_avg_1m_after"] = os.getloadavg()[0]
    return result


def _peft_on(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        if flag == "--use_peft":
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return value.lower() in ("true", "1", "yes")
    return False


if __name__ == "__main__":
    sys.exit(main())
