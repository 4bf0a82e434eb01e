"""`python -m jaxrl.bench --algo distill`: seconds per on-policy distillation step, split into
generation, teacher scoring and update, for jaxrl's `DistillationTrainer` and TRL 1.16's (no
vLLM, PyTorch on the same host) in one run; and the peak memory of the divergence alone (forward
and backward of the generalised JSD over the vocabulary) on both sides at one shape.

Steps: both trainers start from the same student and teacher checkpoints (the embedded recipe's
shipped student and SFT teacher unless `--model_name_or_path` / `--teacher_model_name_or_path`
are given) with the same prompts, batch, completion length, sampling settings, `beta` and
learning rate. Rounds alternate (jaxrl, TRL, jaxrl, TRL, ...) so a change in machine load hits
both; the first `--warmup` steps of a round are not timed. jaxrl: generation is the sampler call
with decoding (and the rollout's shuffle onto the mesh), teacher scoring the jitted teacher pass
over `prompt + completion`, update the jitted optimizer step. TRL: generation is
`_generate_and_score_completions`; its teacher forward runs inside the loss
(`_get_last_hidden_state` on the teacher, timed on its own); update is the rest of the optimizer
step.

Memory: each side runs in a fresh child process on synthetic hidden states and heads of one shape
(`--mem_shape B,C,D_student,D_teacher,V`, default 4,512,256,512,32000: a full f32 `[B, C, V]` is
262 MB); after one warm-up call and `malloc_trim`, a thread samples the process RSS while one
forward+backward runs; the result is the peak RSS above the level before the call. jaxrl also
reports XLA's planned temporary bytes for the compiled forward+backward.

Bench flags: --steps N timed steps per round (default 5), --warmup N (1), --rounds R (2),
--mem_shape B,C,Ds,Dt,V, --no_memory. Other flags are `DistillationConfig` fields (both sides get
the same values). Must not give one side a setting the other lacks: TRL's config is built from
jaxrl's.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxrl.bench.common import last_json_line, split_flags
from jaxrl.data import task
from jaxrl.train import build_trainer

_FLAGS = {"--steps": int, "--warmup": int, "--rounds": int, "--mem_shape": str, "--no_memory": str}


def _split(argv: list[str]) -> tuple[dict, list[str]]:
    argv = [a if a != "--no_memory" else "--no_memory=true" for a in argv]
    return split_flags(
        argv,
        _FLAGS,
        {"steps": 5, "warmup": 1, "rounds": 2, "mem_shape": "4,512,256,512,32000", "no_memory": ""},
    )


# ----------------------------------------------------------------- step times
def _jaxrl_round(trainer, n: int) -> list[tuple[float, float, float]]:
    """`n` optimizer steps; (generation_s, teacher_s, update_s) of each."""
    teacher_s: list[float] = []
    score = trainer._jit_teacher_hidden

    def timed_score(state, rows):
        jax.block_until_ready(rows)
        t0 = time.perf_counter()
        out = jax.block_until_ready(score(state, rows))
        teacher_s.append(time.perf_counter() - t0)
        return out

    trainer._jit_teacher_hidden = timed_score
    times = []
    it = trainer._train_iterator()
    it.skip(trainer._bench_step)
    try:
        for _ in range(n):
            plan = next(it)
            t0 = time.perf_counter()
            trainer._rollout(plan)
            jax.block_until_ready(trainer.rollout)
            t1 = time.perf_counter()
            slices = np.asarray(plan.slices, np.int32)
            trainer.train_state, metrics = trainer._jit_train_step(
                trainer.train_state, trainer.rollout, slices
            )
            jax.block_until_ready(metrics)
            teacher = teacher_s[-1]
            times.append((t1 - t0 - teacher, teacher, time.perf_counter() - t1))
            trainer._bench_step += 1
    finally:
        trainer._jit_teacher_hidden = score
    return times


def _trl_round(
    args: Any, student: str, teacher: str, n: int, prompts: list[Any], tokenizer: Any
) -> list[tuple[float, float, float]]:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    config = trl.DistillationConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_distill_bench_"),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
        beta=args.beta,
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
    trainer = trl.DistillationTrainer(
        model=model,
        teacher_model=teacher_model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    gen_s: list[float] = []
    teacher_s: list[float] = []
    generate = trainer._generate_and_score_completions
    hidden = trainer._get_last_hidden_state
    teacher_module = trainer.accelerator.unwrap_model(trainer.teacher_model)

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        gen_s.append(time.perf_counter() - t0)
        return out

    def timed_hidden(module, *a, **kw):
        if module is not teacher_module:
            return hidden(module, *a, **kw)
        t0 = time.perf_counter()
        out = hidden(module, *a, **kw)
        teacher_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate
    trainer._get_last_hidden_state = timed_hidden
    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()
            self.n_teacher = len(teacher_s)

        def on_step_end(self, *a, **kw):
            step_s.append(time.perf_counter() - self.t0)
            teacher_s[self.n_teacher :] = [sum(teacher_s[self.n_teacher :])]

    trainer.add_callback(StepTimer())
    trainer.train()
    return [(g, t, s - g - t) for g, t, s in zip(gen_s, teacher_s, step_s, strict=True)]


# ----------------------------------------------------------------- divergence memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_during(fn) -> int:
    """Peak RSS above the level before `fn()`, sampled every 0.2 ms from another thread."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand cached free memory back first
    except OSError:
        pass
    base = peak = _rss_bytes()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, _rss_bytes()) - base


def memory_child(side: str, shape: str) -> dict:
    """One side's divergence peak memory (run in a fresh process: `python -c`)."""
    B, C, Ds, Dt, V = map(int, shape.split(","))
    rng = np.random.default_rng(0)
    h_s = rng.standard_normal((B, C, Ds), np.float32)
    h_t = rng.standard_normal((B, C, Dt), np.float32)
    w_s = rng.standard_normal((V, Ds), np.float32) * 0.05
    w_t = rng.standard_normal((V, Dt), np.float32) * 0.05
    mask = np.ones((B, C), np.float32)
    out: dict[str, Any] = {"side": side}
    if side == "jaxrl":
        import jax.numpy as jnp

        from jaxrl.algos.distill import generalized_jsd_from_hidden

        def loss(h, w, ht, wt):
            div, _ = generalized_jsd_from_hidden(h, w, ht, wt, beta=0.5)
            return jnp.sum(div * mask) / mask.sum()

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        xs = [jnp.asarray(x) for x in (h_s, w_s.T.copy(), h_t, w_t.T.copy())]
        compiled = step.lower(*xs).compile()
        analysis = compiled.memory_analysis()
        out["xla_temp_bytes"] = int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
        jax.block_until_ready(compiled(*xs))
        out["peak_rss_delta_bytes"] = _peak_rss_during(lambda: jax.block_until_ready(compiled(*xs)))
    else:
        import torch
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        ts = [torch.from_numpy(x) for x in (h_s, w_s, h_t, w_t)]
        ts[0].requires_grad_(True)
        ts[1].requires_grad_(True)
        N = B * C

        def run():
            div, _ = ChunkedDivergenceFunction.apply(
                ts[0].reshape(N, Ds), ts[1], None, ts[2].reshape(N, Dt), ts[3], None,
                0.5, 1.0, 1.0, None, 1.0, None,
            )  # fmt: skip
            div.sum().div(N).backward()
            ts[0].grad = ts[1].grad = None

        run()
        out["peak_rss_delta_bytes"] = _peak_rss_during(run)
    return out


def _memory(shape: str) -> dict:
    rows = {}
    for side in ("jaxrl", "trl"):
        code = (
            "import json; from jaxrl.bench.distill import memory_child; "
            f"print(json.dumps(memory_child({side!r}, {shape!r})))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        if proc.returncode:
            raise ValueError(f"The {side} divergence-memory child failed:\n{proc.stderr[-2000:]}")
        rows[side] = last_json_line(proc.stdout)
    B, C, _, _, V = map(int, shape.split(","))
    return {
        "mem_shape_B_C_Ds_Dt_V": shape,
        "full_f32_logits_bytes": B * C * V * 4,
        "jaxrl_peak_rss_delta_bytes": rows["jaxrl"]["peak_rss_delta_bytes"],
        "jaxrl_xla_temp_bytes": rows["jaxrl"]["xla_temp_bytes"],
        "trl_peak_rss_delta_bytes": rows["trl"]["peak_rss_delta_bytes"],
    }


# ----------------------------------------------------------------- entry
def run(argv: list[str]) -> dict:
    opts, rest = _split(argv)
    per_round = opts["warmup"] + opts["steps"]
    overrides = ["--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no",
                 "--disable_tqdm", "true", "--report_to", "none",
                 "--max_steps", str(opts["rounds"] * per_round)]  # fmt: skip
    out_dir = tempfile.mkdtemp(prefix="jaxrl_distill_bench_")
    trainer = build_trainer(
        [*rest, *overrides, "--output_dir", out_dir, "--overwrite_output_dir", "true"]
    )
    a = trainer.args
    trainer._ensure_state()
    trainer._bench_step = 0
    student = trainer.model_path
    teacher = a.teacher_model_name_or_path or str(task.asset_path("sft_model"))
    n_prompts = trainer.prompts_per_generation * opts["rounds"] * per_round
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(n_prompts)]
    ours, theirs, first = [], [], None
    for _ in range(opts["rounds"]):
        times = _jaxrl_round(trainer, per_round)
        first = sum(times[0]) if first is None else first
        ours += times[opts["warmup"] :]
        theirs += _trl_round(a, student, teacher, per_round, prompts, trainer.processing_class)[
            opts["warmup"] :
        ]
    ours_a, theirs_a = np.asarray(ours), np.asarray(theirs)
    med = lambda x: float(np.median(x))  # noqa: E731
    step_s, trl_step_s = med(ours_a.sum(1)), med(theirs_a.sum(1))
    result = {
        "algo": "distill",
        "step_s": step_s,
        "generation_s": med(ours_a[:, 0]),
        "teacher_s": med(ours_a[:, 1]),
        "update_s": med(ours_a[:, 2]),
        "compile_s": max(first - step_s, 0.0),
        "trl_step_s": trl_step_s,
        "trl_generation_s": med(theirs_a[:, 0]),
        "trl_teacher_s": med(theirs_a[:, 1]),
        "trl_update_s": med(theirs_a[:, 2]),
        "speedup": trl_step_s / step_s,
        "completions_per_step": trainer.generation_batch_size,
        "max_completion_length": a.max_completion_length,
        "beta": a.beta,
        "timed_steps": len(ours),
        "load_avg_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
    }
    if not opts["no_memory"]:
        result.update(_memory(opts["mem_shape"]))
    return result
