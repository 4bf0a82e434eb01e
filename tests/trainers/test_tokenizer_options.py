"""`RewardConfig.eos_token` and `chat_template_path` (SFT and reward) as TRL 1.16 applies them:
the prepared rows and the saved model config / tokenizer equal TRL's own trainers' on the same
model, tokenizer and data."""

import json

import numpy as np
import pytest
from datasets import Dataset
from test_sft_eos_token import END, END_ID, make_tok
from trainer_utils import assert_logs_match, base_args, tiny_config, train_logs, trl_train_logs

from jaxrl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from jaxrl.lora import LoraConfig

# Puts "=" before each message; differs from make_tok's template in every row.
EQUALS_TEMPLATE = "{% for m in messages %}={{ m['content'] }}{% endfor %}{{ eos_token }}"
PAIRS = {"chosen": ["1+1=2", "3+4=7"], "rejected": ["1+1=3", "3+4=8"]}
CHAT = {
    "messages": [
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
        [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}],
    ]
}


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier (vocab 32, config eos 1) saved by transformers."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2_cls")
    config = tiny_config(vocab_size=32)
    config.num_labels = 1
    config.pad_token_id = 0
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "equals.jinja"
    path.write_text(EQUALS_TEMPLATE)
    return str(path)


def _trl(kind, model_dir, tmp_path, data, **options):
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = make_tok()
    if kind == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        config_cls, trainer_cls = trl.RewardConfig, trl.RewardTrainer
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        config_cls, trainer_cls = trl.SFTConfig, trl.SFTTrainer
    trainer = trainer_cls(
        model=model,
        args=config_cls(
            output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, **options
        ),
        train_dataset=Dataset.from_dict(data),
        processing_class=tok,
    )
    return trainer, model


def _jaxrl(kind, model_dir, tmp_path, data, **options):
    config_cls, trainer_cls = (
        (RewardConfig, RewardTrainer) if kind == "reward" else (SFTConfig, SFTTrainer)
    )
    return trainer_cls(
        model_dir,
        args=config_cls(**base_args(tmp_path / "jaxrl", **options)),
        train_dataset=Dataset.from_dict(data),
        processing_class=make_tok(),
    )


def test_reward_eos_token_matches_trl(reward_dir, tmp_path):
    theirs, model = _trl("reward", reward_dir, tmp_path, PAIRS, eos_token=END)
    ours = _jaxrl("reward", reward_dir, tmp_path, PAIRS, eos_token=END)
    for side in ("chosen", "rejected"):
        rows = ours.train_dataset[f"{side}_input_ids"]
        assert rows == theirs.train_dataset[f"{side}_ids"]
        assert all(row[-1] == END_ID for row in rows)
    assert ours.processing_class.eos_token == END
    assert model.config.eos_token_id == ours.model.config.hf_config.eos_token_id == END_ID
    out = tmp_path / "export"
    ours.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == END_ID


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_chat_template_path_matches_trl(kind, reward_dir, hf_model_dir, template_file, tmp_path):
    if kind == "sft":
        model_dir, data, columns = hf_model_dir, CHAT, [("input_ids", "input_ids")]
    else:
        data = {
            "chosen": [m for m in CHAT["messages"]],
            "rejected": [[m[0], {"role": "assistant", "content": "9"}] for m in CHAT["messages"]],
        }
        model_dir = reward_dir
        columns = [(f"{side}_input_ids", f"{side}_ids") for side in ("chosen", "rejected")]
    theirs, _ = _trl(kind, model_dir, tmp_path, data, chat_template_path=template_file)
    ours = _jaxrl(kind, model_dir, tmp_path, data, chat_template_path=template_file)
    assert ours.processing_class.chat_template == EQUALS_TEMPLATE
    equals = ours.processing_class.convert_tokens_to_ids("=")
    for ours_column, theirs_column in columns:
        assert ours.train_dataset[ours_column] == theirs.train_dataset[theirs_column]
        assert all(row[0] == equals for row in ours.train_dataset[ours_column])


# The source tokenizer's template: ChatML-style markers, which the target tokenizer lacks.
CLONED_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.fixture(scope="module")
def source_tokenizer(tmp_path_factory):
    """A tokenizer directory whose chat template and added tokens (`<|im_start|>`, and its EOS
    `<|im_end|>`) `chat_template_path` clones."""
    from jaxrl.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=abc", chat_template=CLONED_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    path = tmp_path_factory.mktemp("source_tokenizer")
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A tiny Qwen2 causal LM (vocab 32) with an untied LM head, saved by transformers."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny_qwen2_untied")
    config = tiny_config(vocab_size=32)
    config.tie_word_embeddings = False
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_cloned_chat_template_matches_trl(untied_dir, source_tokenizer, tmp_path):
    """`chat_template_path` naming a tokenizer (TRL's `clone_chat_template`): the same
    tokenizer (template, added tokens, EOS, `<extra_id_N>` fill up to a multiple of 64), the same
    resized embedding and untied LM head (old rows kept, new rows at the old rows' mean), the
    same prepared rows and, trained two steps, the same losses and gradient norms as TRL's
    SFTTrainer; the export is a transformers checkpoint of the new vocabulary with the cloned
    EOS in its config and generation config."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = Dataset.from_dict(CHAT)
    args = dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2)
    theirs, theirs_logs = trl_train_logs(
        trl.SFTTrainer,
        trl.SFTConfig,
        untied_dir,
        make_tok(),
        data,
        tmp_path / "trl",
        chat_template_path=source_tokenizer,
        **args,
    )
    ours = SFTTrainer(
        untied_dir,
        args=SFTConfig(
            **base_args(tmp_path / "jaxrl", chat_template_path=source_tokenizer, **args)
        ),
        train_dataset=data,
        processing_class=make_tok(),
    )
    tok, their_tok = ours.processing_class, theirs.processing_class
    assert tok.get_vocab() == their_tok.get_vocab() and len(tok.get_vocab()) == 64
    assert tok.chat_template == CLONED_TEMPLATE and tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(63) == their_tok.convert_ids_to_tokens(63) == "<extra_id_44>"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert ours.train_dataset["input_ids"] == theirs.train_dataset["input_ids"]
    assert all(row[-1] == eos for row in ours.train_dataset["input_ids"])
    assert ours.model.config.vocab_size == 64 and ours.model.config.hf_config.eos_token_id == eos
    # The function itself returns the added tokens' ids, as TRL's (its LoRA path trains them).
    from jaxrl import clone_chat_template
    from jaxrl.models import from_pretrained

    _, _, hf_ids = trl.clone_chat_template(
        AutoModelForCausalLM.from_pretrained(untied_dir), make_tok(), source_tokenizer
    )
    _, _, ids = clone_chat_template(from_pretrained(untied_dir), make_tok(), source_tokenizer)
    assert ids == hf_ids and len(ids) == 64 - 17 and ids[:2] == [17, 18]

    # The resized tables before training: TRL's model after its clone, before its steps, is the
    # checkpoint resized by transformers with the same mean init.
    their_model = AutoModelForCausalLM.from_pretrained(untied_dir, dtype=torch.float32)
    old_embed = their_model.get_input_embeddings().weight.detach().numpy()
    old_head = their_model.lm_head.weight.detach().numpy()
    embed = np.asarray(ours.model.model.embed_tokens.embedding.get_value())
    head = np.asarray(ours.model.lm_head.kernel.get_value()).T
    for new, old in ((embed, old_embed), (head, old_head)):
        assert new.shape == (64, 32)
        np.testing.assert_array_equal(new[:32], old)
        np.testing.assert_allclose(new[32:], np.broadcast_to(old.mean(0), (32, 32)), atol=1e-5)

    ours.train()
    assert_logs_match(train_logs(ours), theirs_logs, ("loss",), steps=2)

    out = tmp_path / "export"
    ours.save_model(str(out))
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (64, eos)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_array_equal(
        exported.lm_head.weight.detach().numpy(),
        np.asarray(ours.model.lm_head.kernel.get_value()).T,
    )


def test_cloned_chat_template_in_a_reward_model(reward_dir, source_tokenizer, tmp_path):
    """The reward trainer clones as TRL's does: same tokenizer, rows and resized (tied) table;
    the score head is untouched."""
    data = {
        "chosen": CHAT["messages"],
        "rejected": [[m[0], {"role": "assistant", "content": "9"}] for m in CHAT["messages"]],
    }
    theirs, their_model = _trl(
        "reward", reward_dir, tmp_path, data, chat_template_path=source_tokenizer
    )
    ours = _jaxrl("reward", reward_dir, tmp_path, data, chat_template_path=source_tokenizer)
    assert ours.processing_class.get_vocab() == theirs.processing_class.get_vocab()
    for side in ("chosen", "rejected"):
        assert ours.train_dataset[f"{side}_input_ids"] == theirs.train_dataset[f"{side}_ids"]
    want = their_model.get_input_embeddings().weight.detach().numpy()
    embed = np.asarray(ours.model.backbone.input_embedding())
    np.testing.assert_allclose(embed, want, atol=1e-5)
    np.testing.assert_array_equal(embed[:32], want[:32])
    score = np.asarray(ours.model.score.kernel.get_value()).T
    np.testing.assert_array_equal(score, their_model.score.weight.detach().numpy())


def test_chat_template_path_refusals(hf_model_dir, source_tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _jaxrl("sft", hf_model_dir, tmp_path, CHAT, chat_template_path=str(tmp_path / "x.jinja"))
    with pytest.raises(ValueError, match="trainable_token_indices"):
        SFTTrainer(
            hf_model_dir,
            args=SFTConfig(**base_args(tmp_path / "lora", chat_template_path=source_tokenizer)),
            train_dataset=Dataset.from_dict(CHAT),
            processing_class=make_tok(),
            peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
        )
