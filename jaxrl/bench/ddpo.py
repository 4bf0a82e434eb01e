"""`--algo ddpo`: DDPO on the tiny SD pipeline (images/s of one sampling batch, seconds of one
update) against TRL v0.7.2 on the same directory (`examples/bench_ddpo_trl072.py`, run with the
old-TRL interpreter given as `--trl_python`). Must not import TRL here.
"""

from __future__ import annotations

import os
import subprocess
import time

import jax
import numpy as np

from jaxrl.bench.common import ROOT, last_json_line
from jaxrl.models.diffusion import jpeg_compressibility
from jaxrl.models.diffusion.tiny import tiny_pipeline
from jaxrl.trainers.ddpo import DDPOTrainer
from jaxrl.trainers.ddpo_config import DDPOConfig


def run_ddpo(argv: list[str]) -> dict:
    """`--algo ddpo`: DDPO on the tiny SD pipeline vs TRL v0.7.2 on the same directory.

    Flags: --sample_num_steps (4), --batch (4), --repeats (3), --trl_python (path; TRL side
    skipped when empty). Times one sampling batch (images/s) and, from a whole DDPO epoch minus
    its sampling, the update (one optimizer update per epoch: train_batch_size = batch), with
    the same measurement on both sides; prints the machine's load average with the numbers.
    """
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
        script = ROOT / "examples" / "bench_ddpo_trl072.py"
        out = subprocess.run(
            [opts["trl_python"], str(script), str(path), str(steps), str(batch), str(repeats)],
            capture_output=True,
            text=True,
            check=True,
        )
        trl = last_json_line(out.stdout)
        result["trl_images_per_s"] = trl["images_per_s"]
        result["trl_update_s"] = trl["update_s"]
        result["sampling_speedup"] = result["images_per_s"] / trl["images_per_s"]
        result["update_speedup"] = trl["update_s"] / max(update_s, 1e-9)
        result["load_avg_1m_after"] = os.getloadavg()[0]
    return result
