"""WandbCallback in offline mode: stable run id across a resume, HF-style key names."""

import pytest

from jaxrl.callbacks import TrainerControl, TrainerState, WandbCallback
from jaxrl.callbacks.wandb import rewrite_logs
from jaxrl.config import TrainingConfig


def test_rewrite_logs_like_hf():
    assert rewrite_logs({"loss": 1.0, "rewards/chosen": 2.0, "eval_loss": 3.0}) == {
        "train/loss": 1.0,
        "train/rewards/chosen": 2.0,
        "eval/loss": 3.0,
    }


@pytest.mark.slow
def test_offline_run_id_is_persisted_and_reused(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    args = TrainingConfig(output_dir=str(tmp_path / "out"), report_to="wandb", run_name="t")

    ids = []
    for global_step in (0, 5):  # a first run, then a resume from step 5
        callback = WandbCallback(project="jaxrl-test")
        state = TrainerState(global_step=global_step, max_steps=10)
        callback.on_train_begin(args, state, TrainerControl())
        ids.append(callback.run.id)
        assert callback.run.config["run_name"] == "t"
        state.global_step += 1
        callback.on_log(args, state, TrainerControl(), logs={"loss": 0.5})
        callback.on_train_end(args, state, TrainerControl())
        assert callback.run is None

    saved_id = (tmp_path / "out" / "wandb_run_id.txt").read_text().strip()
    assert ids == [saved_id, saved_id]
    assert list((tmp_path / "out" / "wandb").glob(f"offline-run-*-{saved_id}"))


def test_init_kwargs_reach_wandb_init_and_ddpo_maps_tracker_fields(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from types import SimpleNamespace

    from jaxrl.trainers.ddpo import DDPOTrainer
    from jaxrl.trainers.ddpo_config import DDPOConfig

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    # DDPO's TRL fields: tracker_project_name -> the project, tracker_kwargs["wandb"] -> init.
    config = DDPOConfig(
        logdir=str(tmp_path / "out"),
        log_with="wandb",
        tracker_project_name="ddpo-test",
        tracker_kwargs={"wandb": {"tags": ["tiny"], "notes": "from tracker_kwargs"}},
    )
    options = DDPOTrainer._wandb_options(SimpleNamespace(args=config))
    callback = WandbCallback(**options)
    callback.on_train_begin(config, TrainerState(max_steps=1), TrainerControl())
    assert callback.run.project == "ddpo-test"
    assert tuple(callback.run.tags) == ("tiny",) and callback.run.notes == "from tracker_kwargs"
    callback.on_train_end(config, TrainerState(max_steps=1), TrainerControl())
    for bad in ({"tensorboard": {}}, {"wandb": {}}):
        log_with = "wandb" if "tensorboard" in bad else None
        with pytest.raises(ValueError, match="tracker_kwargs"):
            DDPOConfig(logdir=str(tmp_path), log_with=log_with, tracker_kwargs=bad)
