"""`--algo ppo`: one PPO iteration of `PPOTrainer` (generate, score, `step()`'s forward pass and
update) against TRL v0.7.2's PPOTrainer on the same tiny random GPT-2, which the TRL side
(`examples/bench_ppo_trl072.py`, run with the old-TRL interpreter) builds and saves first.
Must not import TRL here: the old TRL lives in its own interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import jax
import numpy as np

from jaxrl.bench.common import ROOT, last_json_line
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig


def run_ppo(argv: list[str]) -> dict:
    """jaxrl's PPOTrainer vs TRL v0.7.2's on one tiny model (see the module docstring)."""
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
    script = ROOT / "examples" / "bench_ppo_trl072.py"
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [f.trl_python, str(script), "--out", tmp, *map(str, sizes)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode:
            raise ValueError(f"The TRL v0.7.2 side failed:\n{proc.stderr[-2000:]}")
        trl = last_json_line(proc.stdout)
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
