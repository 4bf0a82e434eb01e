"""load_dataset_any: objects, files, directories with split names, save_to_disk, offline hub."""

import json

import pytest
from datasets import Dataset, DatasetDict

from jaxrl.data import load_dataset_any


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_objects_pass_through():
    ds = Dataset.from_dict({"text": ["a"]})
    assert load_dataset_any(ds) is ds
    dd = DatasetDict({"train": ds, "test": Dataset.from_dict({"text": ["b"]})})
    assert load_dataset_any(dd, split="test")["text"] == ["b"]
    assert load_dataset_any(dd, split=None) is dd
    with pytest.raises(ValueError, match=r"'valid' not found.*\['test', 'train'\]"):
        load_dataset_any(dd, split="valid")


def test_files_and_directories(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}])
    write_jsonl(tmp_path / "test.jsonl", [{"text": "c"}])
    assert load_dataset_any(tmp_path / "train.jsonl")["text"] == ["a", "b"]
    assert load_dataset_any(str(tmp_path))["text"] == ["a", "b"]
    assert load_dataset_any(str(tmp_path), split="test")["text"] == ["c"]
    with pytest.raises(ValueError, match="single file"):
        load_dataset_any(tmp_path / "train.jsonl", split="test")
    Dataset.from_dict({"x": [1, 2]}).to_parquet(str(tmp_path / "d.parquet"))
    assert load_dataset_any(tmp_path / "d.parquet")["x"] == [1, 2]


def test_save_to_disk_directory(tmp_path):
    DatasetDict({"train": Dataset.from_dict({"x": [1]})}).save_to_disk(str(tmp_path / "saved"))
    assert load_dataset_any(str(tmp_path / "saved"))["x"] == [1]


def test_missing_path_and_offline_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load_dataset_any(str(tmp_path / "nope.jsonl"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="offline.*local path"):
        load_dataset_any("trl-lib/Capybara")
