"""`python -m jaxrl.bench --algo {forward,sft,reward,dpo} [bench flags] [train flags]`.

Runs the real jitted train step of the chosen algorithm: a few warm-up steps, then timed steps,
and prints as its last line one JSON object with `algo, step_s, tokens_per_sec, compile_s,
peak_bytes, devices, mfu` (and more). Without `--preset` it benchmarks exactly what
`python -m jaxrl.train --algo ALGO` would train (same flags, real data); with
`--preset NAME --seq_len T` it uses a random-weight model of that shape and synthetic token
data of length T (no download needed). `--algo forward` times forward+backward of the LM loss
only (no optimizer update).

Bench flags: --preset NAME, --seq_len T, --steps N (default 10), --warmup N (default 2).
Everything else is a training-config flag, as for `jaxrl.train`.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
_BENCH_FLAGS = {"--preset": str, "--seq_len": int, "--steps": int, "--warmup": int}


def peak_flops(device) -> float | None:
    kind = device.device_kind
    for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return flops
    return None


def _split_bench_flags(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"preset": None, "seq_len": 512, "steps": 10, "warmup": 2}
    rest, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in _BENCH_FLAGS:
            if "=" in argv[i]:
                value, i = argv[i].split("=", 1)[1], i + 1
            else:
                value, i = argv[i + 1], i + 2
            opts[flag[2:]] = _BENCH_FLAGS[flag](value)
        else:
            rest.append(argv[i])
            i += 1
    return opts, rest


def _synthetic_examples(algo: str, n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    """Token data of exactly `seq_len` per row (DPO/reward: half prompt, half completion; with
    DPO prefix sharing a row holds the prompt and both completions)."""
    rng = np.random.default_rng(seed)

    def ids(length):
        return rng.integers(3, vocab, size=length).tolist()

    half = seq_len // 2
    if algo in ("sft", "forward"):
        return [{"input_ids": ids(seq_len)} for _ in range(n)]
    if algo == "dpo":
        return [
            {
                "prompt_input_ids": ids(half),
                "chosen_input_ids": ids(seq_len - half),
                "rejected_input_ids": ids(seq_len - half),
            }
            for _ in range(n)
        ]
    return [
        {"chosen_input_ids": ids(seq_len), "rejected_input_ids": ids(seq_len)} for _ in range(n)
    ]


def _peak_bytes() -> tuple[int, str]:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


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
            "max_length": opts["seq_len"],
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
    return trainer, opts, algo


def run(argv: list[str]) -> dict:
    from jaxrl.models import presets

    trainer, opts, algo = build(argv)
    a = trainer.args
    accum = a.gradient_accumulation_steps
    n = a.per_device_train_batch_size * trainer.dp * accum
    if opts["preset"] is None:
        host = trainer._collate_micro(next(iter(trainer._train_iterator())), accum)
    else:
        ex = _synthetic_examples(algo, n, opts["seq_len"], opts["vocab"], a.seed)
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
    t0 = time.perf_counter()
    for _ in range(opts["steps"]):
        state, out = step(state)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / opts["steps"]
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
    if algo == "dpo" and trainer.uses_ref_params:
        fpt *= 4 / 3
    devices = jax.devices()
    peak = peak_flops(devices[0])
    tps = tokens / step_s
    mfu = (fpt * computed / step_s / (peak * len(devices))) if peak else None
    peak_bytes, peak_src = _peak_bytes()
    return {
        "algo": algo,
        "step_s": step_s,
        "tokens_per_sec": tps,
        "steps_per_sec": 1 / step_s,
        "compile_s": compile_s,
        "peak_bytes": peak_bytes,
        "peak_bytes_source": peak_src,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mfu": mfu,
        "tokens_per_step": tokens,
        "computed_tokens_per_step": computed,
        "seq_len": seq_len,
        "global_batch": n,
        "preset": opts["preset"],
        "compute_dtype": jnp.dtype(trainer.compute_dtype).name,
        "scan_layers": a.scan_layers,
        "prefix_sharing": getattr(a, "prefix_sharing", None),
        "steps": opts["steps"],
    }


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if any(a.split("=", 1)[0] == "--use_peft" for a in argv) and _peft_on(argv):
            result = run_lora(argv)
        else:
            result = run(argv)
    except ValueError as e:
        print(f"jaxrl.bench: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _peft_on(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        if flag == "--use_peft":
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return value.lower() in ("true", "1", "yes")
    return False


if __name__ == "__main__":
    sys.exit(main())
