"""`--algo sft --use_peft true`: SFT step time and memory of jaxrl full fine-tuning, LoRA and
QLoRA (NF4 base) against TRL full and TRL + PEFT LoRA on the same random tiny Qwen2 and the same
token batches, each case in its own `python -m jaxrl.bench ... --lora_case CASE` process so that
peak memory is per case. Must not time anything in the parent process.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxrl import lora
from jaxrl.bench.common import last_json_line, peak_memory, synthetic_examples
from jaxrl.data import task
from jaxrl.trainers import SFTConfig, SFTTrainer

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
    ex = synthetic_examples("sft", n, opts["seq_len"], 1024, 0)
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
    peak, src = peak_memory()
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
    rows = synthetic_examples("sft", n, opts["seq_len"], 1024, 0)
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
            results[case] = last_json_line(proc.stdout)
        results["load_avg_1m_end"] = os.getloadavg()[0]
    return results
