"""TRL v0.7.2 side of `python -m jaxrl.bench --algo ddpo` (run with /work/.peer-trl072/bin/python).

Usage: bench_ddpo_trl072.py PIPELINE_DIR STEPS BATCH REPEATS. Builds TRL's DDPOTrainer on the
same diffusers directory (LoRA, f32 on CPU), times `_generate_samples` (one batch) and a whole
`step` (sampling + rewards + updates), and prints one JSON line: images_per_s, update_s.
"""

import io
import json
import sys
import time

import numpy as np
import torch
from PIL import Image
from trl import DDPOConfig, DDPOTrainer, DefaultDDPOStableDiffusionPipeline


def compressibility(images, prompts, metadata):
    sizes = []
    for im in (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(im.transpose(1, 2, 0)).save(buf, format="JPEG", quality=95)
        sizes.append(-buf.tell() / 1000)
    return torch.tensor(sizes), {}


def main():
    path, steps, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    cfg = DDPOConfig(
        sample_num_steps=steps,
        sample_batch_size=batch,
        train_batch_size=batch,
        sample_num_batches_per_epoch=1,
        mixed_precision="no",
        num_epochs=1,
        logdir="/tmp/trl_ddpo_bench",
        save_freq=10**6,
    )
    pipe = DefaultDDPOStableDiffusionPipeline(path, use_lora=True)
    prompts = ["a photo of a cat", "a photo of a dog"]
    rng = np.random.default_rng(0)
    trainer = DDPOTrainer(cfg, compressibility, lambda: (str(rng.choice(prompts)), {}), pipe)
    trainer._generate_samples(iterations=1, batch_size=batch)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        trainer._generate_samples(iterations=1, batch_size=batch)
    sample_s = (time.perf_counter() - t0) / repeats
    trainer.step(0, 0)  # warm-up
    t0 = time.perf_counter()
    for i in range(repeats):
        trainer.step(i + 1, 0)
    step_s = (time.perf_counter() - t0) / repeats
    print(json.dumps({"images_per_s": batch / sample_s, "update_s": max(step_s - sample_s, 0.0)}))


if __name__ == "__main__":
    main()
