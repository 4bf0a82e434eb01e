"""Shared tiny setup for trainer tests: a 2-layer Qwen2-shaped config over the embedded task's
character tokenizer, and small slices of the shipped task data."""

import datasets
import pytest
from trainer_utils import tiny_config

from jaxrl.data import task


@pytest.fixture(scope="session")
def tokenizer():
    return task.load_tokenizer()


def _rows(name: str, n: int) -> datasets.Dataset:
    ds = datasets.load_dataset("json", data_files=str(task.asset_path(name)), split="train")
    return ds.select(range(n))


@pytest.fixture(scope="session")
def sft_data():
    return _rows("sft_train.jsonl", 64), _rows("sft_test.jsonl", 20)


@pytest.fixture(scope="session")
def pref_data():
    return _rows("dpo_train.jsonl", 64), _rows("dpo_test.jsonl", 20)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory, tokenizer):
    """A tiny random Qwen2 causal LM saved by transformers (PyTorch), with the tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(tiny_config()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
