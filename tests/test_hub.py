"""push_to_hub: repo from hub_model_id (default: output_dir's name), privacy, revision, model card,
and the checkpoint layout each hub_strategy uses. The Hub itself is faked (no network)."""

import types

import pytest

from jaxrl import SFTConfig, hub
from jaxrl.config import ConfigError


class FakeApi:
    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        FakeApi.calls.append(("create", repo_id, private, self.token))
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **kw):
        FakeApi.calls.append(("upload", kw))
        return types.SimpleNamespace(commit_url=f"https://hub/{kw['repo_id']}/commit/1")


def test_push_folder(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    FakeApi.calls = []
    out = tmp_path / "my-run"
    out.mkdir()
    args = SFTConfig(
        output_dir=str(out),
        push_to_hub=True,
        hub_strategy="end",
        hub_private_repo=True,
        hub_token="t0k",
        hub_revision="dev",
    )
    assert args.hub_model_id == "my-run"
    url = hub.push_folder(args, str(out))
    assert url == "https://hub/my-run/commit/1"
    (create, upload) = FakeApi.calls
    assert create == ("create", "my-run", True, "t0k")
    assert upload[1]["revision"] == "dev" and upload[1]["folder_path"] == str(out)


def test_hub_strategies():
    assert hub.checkpoint_path_in_repo("checkpoint", 7) == "last-checkpoint"
    assert hub.checkpoint_path_in_repo("all_checkpoints", 7) == "checkpoint-7"
    assert hub.checkpoint_path_in_repo("every_save", 7) is None
    assert not hub.pushes_on_save("end") and hub.pushes_on_save("every_save")
    assert SFTConfig(push_to_hub=True).hub_strategy == "every_save"  # HF's default
    with pytest.raises(ConfigError, match="`hub_strategy='sometimes'` is not valid"):
        SFTConfig(hub_strategy="sometimes")
