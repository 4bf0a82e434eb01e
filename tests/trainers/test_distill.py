"""DistillationTrainer against TRL 1.16's DistillationTrainer on tiny models with scripted
(fixed) completions on both sides: the same divergence (`loss`) and student entropy at beta 0,
0.5 and 1 at the first step, and the same loss after one optimizer update (f32, 1e-5); and bad
input refused with a clear message (a teacher with another vocabulary, a teacher that is not a
causal LM, no teacher, a dataset without prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Qwen2Config

from jaxrl import DistillationConfig, DistillationTrainer, lora
from jaxrl.config import ConfigError
from jaxrl.data import task
from jaxrl.trainers.online import Generation
from tests.trainers.trainer_utils import tiny_config

PROMPTS = ["12+34=", "5+6=", "70+8=", "9+99="]
COMPLETIONS = ["46", "11", "78", "108"]  # fixed, some with EOS, one cut (no EOS)


def _save(cfg: Qwen2Config, path: Path, seed: int) -> str:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path)
    task.load_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_models")
    teacher_cfg = tiny_config().to_dict()
    teacher_cfg.update(hidden_size=48, num_hidden_layers=3, intermediate_size=96)
    teacher_cfg.pop("layer_types", None)
    teacher_cfg = Qwen2Config(**teacher_cfg)
    return _save(tiny_config(), root / "student", 0), _save(teacher_cfg, root / "teacher", 1)


def _scripted_ids(tok) -> dict[tuple, list[int]]:
    out = {}
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        ids = tok(text=c)["input_ids"]
        out[tuple(tok(text=p)["input_ids"])] = ids if i == 3 else ids + [tok.eos_token_id]
    return out


def _trl_metrics(student, teacher, tmp_path, beta):
    import datasets
    import trl

    tok = task.load_tokenizer()
    scripted = _scripted_ids(tok)
    args = trl.DistillationConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=2,
        logging_steps=1, learning_rate=1e-2, bf16=False, beta=beta, temperature=0.9,
        report_to="none", save_strategy="no", max_completion_length=4, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.DistillationTrainer(
        model=student, teacher_model=teacher, args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
    )  # fmt: skip
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: [
        scripted[tuple(p)] for p in prompt_ids
    ]
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _scripted_generate(tok, completion_ids):
    """A stand-in for `trainer._generate` that returns `completion_ids(prompt_ids)` (EOS
    included where it ends a completion) in the sampler's padded layout."""

    def generate(prompt_ids, config, seed, **kw):
        comps = completion_ids(prompt_ids)
        P, C = max(map(len, prompt_ids)), max(map(len, comps))
        pad = tok.pad_token_id
        pids = [[pad] * (P - len(p)) + list(p) for p in prompt_ids]
        pmask = [[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids]
        cids = [c + [pad] * (C - len(c)) for c in comps]
        cmask = [[1] * len(c) + [0] * (C - len(c)) for c in comps]
        out = SimpleNamespace(
            prompt_ids_BP=jnp.asarray(pids, jnp.int32), prompt_mask_BP=jnp.asarray(pmask, jnp.int32),
            completion_ids_BN=jnp.asarray(cids, jnp.int32),
            completion_mask_BN=jnp.asarray(cmask, jnp.int32),
        )  # fmt: skip
        lengths = np.array([len(c) for c in comps])
        return Generation(out, comps, lengths, tok.batch_decode(comps, skip_special_tokens=True))

    return generate


def _jaxrl_metrics(student, teacher, tmp_path, beta, check=None, trainer_kw=None, **kw):
    tok = task.load_tokenizer()
    scripted = _scripted_ids(tok)
    args = DistillationConfig(
        output_dir=str(tmp_path / "jaxrl"), per_device_train_batch_size=4, max_steps=2,
        logging_steps=1, learning_rate=1e-2, bf16=False, beta=beta, temperature=0.9,
        report_to="none", save_strategy="no", max_completion_length=4, seed=0,
        disable_tqdm=True, mesh_data=1, mesh_fsdp=1, **kw,
    )  # fmt: skip
    trainer = DistillationTrainer(
        student, teacher, args=args, train_dataset=[{"prompt": p} for p in PROMPTS],
        processing_class=tok, **(trainer_kw or {}),
    )  # fmt: skip
    if check is not None:
        check(trainer)
    trainer._generate = _scripted_generate(tok, lambda ids: [scripted[tuple(p)] for p in ids])
    trainer.train()
    lines = (tmp_path / "jaxrl" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_per_step_parity_with_trl(models, tmp_path, beta):
    student, teacher = models
    theirs = _trl_metrics(student, teacher, tmp_path, beta)
    ours = _jaxrl_metrics(student, teacher, tmp_path, beta)
    assert len(theirs) == len(ours) == 2
    for t, o in zip(theirs, ours, strict=True):
        np.testing.assert_allclose(o["loss"], t["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(o["entropy"], t["entropy"], rtol=1e-5, atol=1e-6)
        for k in ("completions/mean_length", "completions/clipped_ratio"):
            assert o[k] == pytest.approx(t[k]), k
    assert ours[0]["loss"] != pytest.approx(ours[1]["loss"])  # the update changed the student


def _args(tmp_path, **kw):
    return DistillationConfig(
        output_dir=str(tmp_path), bf16=False, mesh_data=1, mesh_fsdp=1, report_to="none",
        max_completion_length=4, **kw,
    )  # fmt: skip


def test_teacher_with_another_vocabulary_is_refused(models, tmp_path):
    student, _ = models
    other = _save(tiny_config(vocab_size=24), tmp_path / "other", 2)
    with pytest.raises(ValueError, match="vocab_size 16 but the teacher model has vocab_size 24"):
        DistillationTrainer(
            student, other, args=_args(tmp_path / "o"), train_dataset=[{"prompt": "1+1="}],
            processing_class=task.load_tokenizer(),
        )  # fmt: skip


def test_teacher_that_is_not_a_causal_lm_is_refused(models, tmp_path):
    student, _ = models
    bad = tmp_path / "not_lm"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 16}))
    with pytest.raises(ValueError, match="teacher"):
        DistillationTrainer(
            student, str(bad), args=_args(tmp_path / "o"), train_dataset=[{"prompt": "1+1="}],
            processing_class=task.load_tokenizer(),
        )  # fmt: skip


def test_missing_teacher_prompt_column_and_bad_fields(models, tmp_path):
    student, teacher = models
    tok = task.load_tokenizer()
    with pytest.raises(ValueError, match="teacher model is required"):
        DistillationTrainer(student, args=_args(tmp_path / "a"), train_dataset=[{"prompt": "1="}])
    with pytest.raises(ValueError, match="'prompt' column"):
        DistillationTrainer(
            student, teacher, args=_args(tmp_path / "b"), train_dataset=[{"text": "1+1="}],
            processing_class=tok,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="beta must be in"):
        _args(tmp_path / "c", beta=1.5)
    with pytest.raises(ConfigError, match="use_vllm"):
        _args(tmp_path / "d", use_vllm=True)
    assert DistillationConfig(output_dir="x").learning_rate == 1e-6  # TRL's default
    assert DistillationConfig(output_dir="x").beta == 1.0


def test_log_completions_table_file_and_wandb(models, tmp_path, capsys, monkeypatch):
    """TRL's `log_completions`: each training log prints `num_completions_to_print` of its own
    step's completions (Prompt and Completion only, no Advantage), writes all of them to
    `completions/completions_<step>.parquet` (step, prompt, completion), and logs the wandb Table
    `completions`, one row per prompt with `log_unique_prompts`; an evaluation's log shows the
    evaluation's completions. Each generation call here answers with its own call number, so a
    file holding another step's completions fails."""
    import pandas as pd
    import wandb

    student, teacher = models
    tok = task.load_tokenizer()
    prompts = ["1+1=", "1+1=", "2+2=", "3+3="]  # a repeated prompt: log_unique_prompts drops it
    args = _args(
        tmp_path, per_device_train_batch_size=4, max_steps=3, logging_steps=1,
        learning_rate=1e-2, save_strategy="no", disable_tqdm=True, log_completions=True,
        num_completions_to_print=2, log_unique_prompts=True, shuffle_dataset=False,
    )  # fmt: skip
    trainer = DistillationTrainer(
        student, teacher, args=args, train_dataset=[{"prompt": p} for p in prompts],
        processing_class=tok,
    )  # fmt: skip
    calls = []

    def answer(ids):  # call c: every completion is the digit c (then EOS)
        calls.append(len(ids))
        return [tok(text=str(len(calls)))["input_ids"] + [tok.eos_token_id] for _ in ids]

    trainer._generate = _scripted_generate(tok, answer)
    logged = []
    monkeypatch.setattr(wandb, "run", object())
    monkeypatch.setattr(wandb, "log", lambda data: logged.append(data))
    trainer.args.report_to = ["wandb"]  # after construction: no wandb callback, only the table
    trainer.train()
    printed = capsys.readouterr().out
    for step in (1, 2, 3):
        frame = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        assert list(frame.columns) == ["step", "prompt", "completion"]
        assert sorted(frame["prompt"]) == sorted(prompts)
        assert set(frame["completion"]) == {str(step)}, step  # its own step's completions
        assert set(frame["step"]) == {step}
        assert f"Step {step}" in printed
    assert "Advantage" not in printed
    rows = [line for line in printed.splitlines() if "=" in line and "│" in line]
    tables = [d["completions"] for d in logged if "completions" in d]
    assert len(tables) == 4  # the three step logs and the end-of-training summary log
    assert len(rows) == 4 * 2  # num_completions_to_print rows per log
    assert all(len(t.data) == 3 for t in tables)  # one row per prompt
    assert tables[0].columns == ["step", "prompt", "completion"]

    # TRL's `num_tokens`: the running count of prompt + completion tokens (here 2 per completion).
    per_step = sum(len(tok(text=p)["input_ids"]) + 2 for p in prompts)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    counts = {m["step"]: m["num_tokens"] for m in map(json.loads, lines) if "loss" in m}
    assert counts == {1: per_step, 2: 2 * per_step, 3: 3 * per_step}

    trainer._generate = _scripted_generate(tok, lambda ids: [[tok.eos_token_id] for _ in ids])
    trainer.evaluate([{"prompt": "9+9="}, {"prompt": "8+8="}])
    frame = pd.read_parquet(tmp_path / "completions" / "completions_00003.parquet")
    assert set(frame["prompt"]) >= {"9+9=", "8+8="}


@pytest.mark.slow
def test_int8_teacher_matches_trl_on_the_dequantized_teacher(models, tmp_path):
    """`teacher_model_quantization="int8"`: the teacher is stored as int8 (one absmax / 127 scale
    per output channel) in the train state, and the losses of the first step and of the step
    after one update equal TRL's on a teacher whose weights are that round trip computed
    directly in torch (every matrix, row-wise: the output channels of a Linear, the token rows
    of the embedding; vectors kept; an all-zero row, the padding embedding, stays zero)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl.core.quant import QuantizedArray

    student, teacher = models
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                absmax = p.abs().amax(dim=1, keepdim=True)
                scale = torch.where(absmax > 0, absmax / 127.0, 1.0)  # an all-zero row stays 0
                p.copy_(torch.clamp(torch.round(p / scale), -127, 127) * scale)
    fake = tmp_path / "teacher_int8_roundtrip"
    model.save_pretrained(fake)
    task.load_tokenizer().save_pretrained(fake)

    def stored_as_int8(trainer):
        trainer._ensure_state()
        leaves = jax.tree.leaves(
            trainer.train_state.frozen["teacher"],
            is_leaf=lambda x: isinstance(x, QuantizedArray),
        )
        assert any(isinstance(x, QuantizedArray) for x in leaves)

    theirs = _trl_metrics(student, str(fake), tmp_path, 1.0)
    ours = _jaxrl_metrics(
        student, teacher, tmp_path, 1.0, check=stored_as_int8, teacher_model_quantization="int8"
    )
    assert len(theirs) == len(ours) == 2
    for t, o in zip(theirs, ours, strict=True):
        np.testing.assert_allclose(o["loss"], t["loss"], rtol=1e-5, atol=1e-6)
    # ... and not the unquantized teacher's loss: the round trip moved it beyond that tolerance.
    unquantized = _trl_metrics(student, teacher, tmp_path / "f32", 1.0)
    assert abs(unquantized[0]["loss"] - ours[0]["loss"]) > 1e-5 * abs(ours[0]["loss"]) + 1e-6


@pytest.mark.slow
def test_lora_student_first_step_is_the_merged_models(models, tmp_path):
    """A LoRA student (random A and B, so the adapter changes the model from step 0): its first
    loss equals that of a full student holding the merged weights `W + (alpha / r) B A` (computed
    by `lora.merge_lora`) at 1e-5, and one update moves it (only the adapters train)."""
    student, teacher = models
    config = lora.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False
    )
    merged = {}

    def keep_merged(trainer):
        n_trainable, _ = lora.trainable_parameters(trainer.model)
        assert 0 < n_trainable
        merged["model"] = lora.merge_lora(trainer.model)

    ours = _jaxrl_metrics(
        student, teacher, tmp_path / "lora", 1.0, check=keep_merged,
        trainer_kw={"peft_config": config},
    )  # fmt: skip
    full = _jaxrl_metrics(merged["model"], teacher, tmp_path / "full", 1.0)
    np.testing.assert_allclose(ours[0]["loss"], full[0]["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours[0]["entropy"], full[0]["entropy"], rtol=1e-5, atol=1e-6)
    assert ours[1]["loss"] != pytest.approx(ours[0]["loss"])
    base = _jaxrl_metrics(student, teacher, tmp_path / "base", 1.0)  # the adapter mattered
    assert base[0]["loss"] != pytest.approx(ours[0]["loss"], rel=1e-4)
