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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:2] == ["--algo", "ddpo"] or argv[:1] == ["--algo=ddpo"]:
            result = run_ddpo(argv[2:] if argv[0] == "--algo" else argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())
