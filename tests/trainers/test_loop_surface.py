"""The HF Trainer surface of the shared loop: `train()`'s TrainOutput, the process-zero methods,
`logging_strategy`, best-model tracking (`save_strategy="best"`, `load_best_model_at_end`,
`save_total_limit` sparing the best step), `save_only_model` and HF's checkpoint paths for
`resume_from_checkpoint`."""

import json
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from trainer_utils import base_args, killed_after_checkpoint, tiny_config, train_logs

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.checkpoint import Checkpointer
from jaxrl.trainers import TrainLoop, TrainOutput
from tests.model_calls import jit_call


def forward(model, ids, mask) -> np.ndarray:
    """`model(ids, mask)` (the logits), jitted."""
    return np.asarray(jit_call(model, ids, mask))


def make(tmp_path, tokenizer, sft_data, eval_data=None, **kw):
    return SFTTrainer(
        tiny_config(),
        args=SFTConfig(**base_args(tmp_path, **kw)),
        train_dataset=sft_data[0],
        eval_dataset=eval_data,
        processing_class=tokenizer,
    )


@pytest.mark.slow
def test_train_output_and_logging_strategies(tmp_path, tokenizer, sft_data, monkeypatch):
    # 64 examples / 16 per step: an epoch is 4 steps; 6 steps end mid-epoch.
    kw = dict(per_device_train_batch_size=16, max_steps=6)
    trainer = make(tmp_path / "steps", tokenizer, sft_data, **kw)
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    monkeypatch.setenv("LOCAL_RANK", "1")  # a launcher's second process on this host
    assert not trainer.is_local_process_zero() and trainer.is_world_process_zero()
    monkeypatch.delenv("LOCAL_RANK")
    out = trainer.train()
    losses = [h["loss"] for h in train_logs(trainer)]
    assert isinstance(out, TrainOutput) and out.global_step == 6 and len(losses) == 6
    # HF: the summed step losses over the steps run; the summary is logged and returned.
    assert out.training_loss == pytest.approx(np.mean(losses), rel=1e-6)
    assert out.metrics["train_loss"] == out.training_loss
    summary = trainer.state.log_history[-1]
    assert {k: summary[k] for k in out.metrics} == out.metrics
    runtime = out.metrics["train_runtime"]
    assert out.metrics["train_steps_per_second"] == pytest.approx(6 / runtime, rel=1e-2)
    assert out.metrics["train_samples_per_second"] == pytest.approx(96 / runtime, rel=1e-2)
    assert out.metrics["epoch"] == 1.5

    epoch = make(tmp_path / "epoch", tokenizer, sft_data, logging_strategy="epoch", **kw)
    epoch.args.logging_first_step = True
    out_epoch = epoch.train()
    logged = train_logs(epoch)
    # Step 1 (logging_first_step) and the epoch end (step 4); the window since the last log is
    # averaged, as HF; steps 5-6 end mid-epoch and are not logged.
    assert [h["step"] for h in logged] == [1, 4]
    assert logged[0]["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert logged[1]["loss"] == pytest.approx(np.mean(losses[1:4]), rel=1e-5)
    assert out_epoch.training_loss == pytest.approx(out.training_loss, rel=1e-5)

    silent = make(tmp_path / "no", tokenizer, sft_data, logging_strategy="no", **kw)
    out_no = silent.train()
    assert train_logs(silent) == [] and len(silent.state.log_history) == 1  # the summary only
    assert out_no.training_loss == pytest.approx(out.training_loss, rel=1e-5)


@pytest.mark.slow
def test_summary_train_loss_is_the_whole_runs_after_a_resume(tmp_path, tokenizer, sft_data):
    """HF's train_loss is the mean step loss over the run: a run resumed from its step-2
    checkpoint reports the 4-step mean (the running sum is in the checkpoint), not the mean of
    steps 3-4; a finished run resumed trains nothing and keeps one summary line with that mean,
    not a second one with train_loss 0.0."""
    save = dict(max_steps=4, save_strategy="steps", save_steps=2)
    full = make(tmp_path / "full", tokenizer, sft_data, **save)
    out = full.train()
    losses = [h["loss"] for h in train_logs(full)]
    assert len(losses) == 4 and out.training_loss == pytest.approx(np.mean(losses), rel=1e-6)

    killed_after_checkpoint(tmp_path / "full", 2, tmp_path / "part")
    part = make(tmp_path / "part", tokenizer, sft_data, resume_from_checkpoint=True, **save)
    out_part = part.train()
    assert [h["loss"] for h in train_logs(part) if h["step"] > 2] == losses[2:]
    assert out_part.training_loss == out.training_loss
    assert out_part.training_loss != pytest.approx(np.mean(losses[2:]), rel=1e-6)

    again = make(tmp_path / "full", tokenizer, sft_data, resume_from_checkpoint=True, **save)
    assert again.train().training_loss == out.training_loss
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["train_loss"] for r in rows if "train_loss" in r] == [out.training_loss]


def _eval_losses(trainer) -> dict[int, float]:
    return {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}


@pytest.mark.slow  # end to end: full training runs
def test_save_strategy_best_and_load_best_model_at_end(tmp_path, tokenizer, sft_data):
    # greater_is_better=True on eval_loss makes the first evaluation the best one (training
    # lowers the held-out loss), so the best model is not the last one.
    trainer = make(
        tmp_path,
        tokenizer,
        sft_data,
        eval_data=sft_data[1],
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="best",
        metric_for_best_model="loss",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    trainer.train()
    evals = _eval_losses(trainer)
    assert list(evals) == [1, 2, 3] and evals[1] > evals[2] > evals[3]
    s = trainer.state
    assert s.best_global_step == 1 and s.best_metric == pytest.approx(evals[1])
    assert s.best_model_checkpoint == str(tmp_path / "checkpoints" / "checkpoint-1")
    # "best": saved only when the metric improved (once, at step 1).
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]
    # The best params are the current ones: what evaluate() and save_model() see.
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[1], rel=1e-6)
    # HF's `trainer.model` after train(): the model with those params (the one exported).
    from jaxrl import models

    trainer.save_model(str(tmp_path / "export"))
    exported = models.from_pretrained(tmp_path / "export")
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 60
    mask = np.ones_like(ids)
    np.testing.assert_allclose(
        forward(trainer.model, ids, mask), forward(exported, ids, mask), atol=1e-5
    )


@pytest.mark.slow
def test_save_only_model_best_checkpoint_survives_rotation(tmp_path, tokenizer, sft_data):
    run = dict(
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        save_only_model=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    trainer = make(tmp_path, tokenizer, sft_data, eval_data=sft_data[1], **run)
    trainer.train()
    evals = _eval_losses(trainer)
    assert trainer.state.best_global_step == 1 and evals[1] > evals[3]
    ckpt = Checkpointer(tmp_path / "checkpoints")
    # HF: rotation spares the best step; with save_total_limit=1 only it stays at the end.
    assert ckpt.all_steps() == [1] and ckpt.metadata(1)["save_only_model"] is True
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[1], rel=1e-6)
    # A model-only checkpoint has no optimizer state: resuming from it is refused (HF).
    again = make(
        tmp_path,
        tokenizer,
        sft_data,
        eval_data=sft_data[1],
        resume_from_checkpoint=str(ckpt.step_dir(1)),
        **run,
    )
    with pytest.raises(ValueError, match="save_only_model=True.*cannot resume"):
        again.train()


def test_resume_from_checkpoint_accepts_hf_paths(tmp_path):
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    for step in (2, 5):
        ckpt.save(step, {"w": jnp.zeros(2)}, {"step": step})
    ckpt.close()
    (run / "checkpoints" / "7").mkdir()  # jaxrl's old layout

    loop = TrainLoop()
    loop.args = SimpleNamespace(output_dir=str(tmp_path / "other"), save_total_limit=None)
    assert loop._resolve_resume(True) is None  # this run has no checkpoint yet
    assert loop._resolve_resume(str(run / "checkpoints" / "checkpoint-2")) == 2
    assert loop._checkpointer().directory == run / "checkpoints"  # that run's folder
    assert loop._resolve_resume(str(run / "checkpoints")) == 5  # its newest step
    assert loop._resolve_resume(str(run)) == 5  # a run's output_dir
    with pytest.raises(ValueError, match="rename it to checkpoint-7"):
        loop._resolve_resume(str(run / "checkpoints" / "7"))
    with pytest.raises(ValueError, match="no checkpoint there"):
        loop._resolve_resume(str(tmp_path / "missing"))


class _FakeHub:
    """huggingface_hub.HfApi without a network: records what would be uploaded."""

    uploads: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=None, exist_ok=False):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **kw):
        files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
        _FakeHub.uploads.append((kw["path_in_repo"], kw["commit_message"], files))
        return SimpleNamespace(commit_url="https://hub/commit")


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
@pytest.mark.slow
def test_hub_strategy_uploads_at_each_save(tmp_path, tokenizer, sft_data, monkeypatch, strategy):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.uploads = []
    trainer = make(
        tmp_path, tokenizer, sft_data, max_steps=2, save_strategy="steps", save_steps=1,
        push_to_hub=True, hub_model_id="me/run", hub_strategy=strategy,
    )  # fmt: skip
    trainer.train()
    paths = [u[0] for u in _FakeHub.uploads]
    checkpoint = {
        "checkpoint": ["last-checkpoint"] * 2,
        "all_checkpoints": ["checkpoint-1", "checkpoint-2"],
    }[strategy]
    # Per save: the model in output_dir (HF's every_save part), then the checkpoint folder.
    assert paths == [None, checkpoint[0], None, checkpoint[1]]
    assert [u[1] for u in _FakeHub.uploads] == ["Training in progress, step 1"] * 2 + [
        "Training in progress, step 2"
    ] * 2
    model_files = _FakeHub.uploads[2][2]
    assert {"model.safetensors", "config.json", "README.md"} <= set(model_files)
    # The uploaded model is the model after step 2.
    from jaxrl import models

    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 16
    mask = np.ones_like(ids)
    np.testing.assert_allclose(
        forward(models.from_pretrained(tmp_path), ids, mask),
        forward(trainer.model, ids, mask),
        atol=1e-5,
    )
