"""Data: loading, TRL dataset formats, tokenization, packing, collation and batching (host-side)."""

from jaxrl.data.batching import BatchIterator
from jaxrl.data.char_tokenizer import build_char_tokenizer
from jaxrl.data.collate import (
    choose_seq_len,
    collate_preference,
    collate_preference_shared,
    collate_reward,
    collate_sft,
)
from jaxrl.data.formats import extract_prompt, is_conversational
from jaxrl.data.loading import load_dataset_any
from jaxrl.data.packing import pack_bfd, pack_wrapped
from jaxrl.data.preference import prepare_preference_dataset
from jaxrl.data.reward import prepare_reward_dataset
from jaxrl.data.sft import prepare_sft_dataset

__all__ = [
    "BatchIterator",
    "build_char_tokenizer",
    "choose_seq_len",
    "collate_preference",
    "collate_preference_shared",
    "collate_reward",
    "collate_sft",
    "extract_prompt",
    "is_conversational",
    "load_dataset_any",
    "pack_bfd",
    "pack_wrapped",
    "prepare_preference_dataset",
    "prepare_reward_dataset",
    "prepare_sft_dataset",
]
