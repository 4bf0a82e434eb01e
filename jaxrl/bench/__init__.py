"""`python -m jaxrl.bench --algo {forward,sft,reward,dpo,generate,ppo,grpo,ddpo,distill} [flags]`.

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

`--algo distill` times jaxrl's DistillationTrainer against TRL 1.16's in one run (generation,
teacher scoring, update) and the divergence's peak memory on both sides (`distill.py`).

The package: `common.py` (flag splitting, peak memory, timing, MFU, synthetic rows), one module
per runner (`step.py` sft/forward/reward/dpo, `lora.py`, `generate.py`, `grpo.py`, `ppo.py`,
`ddpo.py`, `distill.py`, `compare.py` for `--compare trl`), and `cli.py` (`main` and the `--algo` table).
Importing it runs nothing.
"""

from jaxrl.bench.cli import main
from jaxrl.bench.common import PEAK_FLOPS, long_tail_lengths, peak_flops, split_flags
from jaxrl.bench.compare import SWEEP, compare_commands

__all__ = [
    "PEAK_FLOPS",
    "SWEEP",
    "compare_commands",
    "long_tail_lengths",
    "main",
    "peak_flops",
    "split_flags",
]
