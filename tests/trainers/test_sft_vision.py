"""Image-text SFT (TRL's vision datasets: `images` + `messages` with `{"type": "image"}` parts,
or prompt/completion) of a tiny Gemma 3 equals TRL 1.16's SFTTrainer step for step, with the
collator's batches equal to TRL's `DataCollatorForVisionLanguageModeling`; the options TRL
refuses (or jaxrl does not run) on images are errors, and so are images for a text-only model.

One fixture: a Gemma3Processor built offline (the task's word-level tokenizer plus Gemma 3's
image tokens and a small chat template; 28 x 28 images, 4 tokens each) and a tiny random
`Gemma3ForConditionalGeneration` (2 SigLIP layers, the 2-layer Gemma 3 text model)."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from test_sft_trl_options import METRICS
from trainer_utils import assert_logs_match, base_args, train_logs, trl_train_logs

from jaxrl import SFTConfig, SFTTrainer
from jaxrl.data import vision
from tests.model_calls import jit_call

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<start_of_image>' }}{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>' }}{% endif %}"
)


# The same rendering with the assistant turns marked for `assistant_only_loss`.
TRAINING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{{ '<end_of_turn>' }}"
    "{% endgeneration %}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<start_of_image>' }}{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>' }}{% endif %}{% endfor %}"
)


def _processor(tokenizer):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    tok = tokenizer.__class__.from_pretrained(
        tokenizer.name_or_path,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    return Gemma3Processor(images, tok, chat_template=TEMPLATE, image_seq_length=4)


# The checkpoint's directory, once built in this process (nothing writes into it).
_VLM_DIR: list[str] = []


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, tokenizer):
    """The tiny model and processor, saved. `test_dpo_vision` and `test_grpo_vision` import
    this fixture, which makes it a module fixture of each: the checkpoint is built once per
    process (~3.4 s CPU each time) and every module's fixture returns it."""
    if not _VLM_DIR:
        _VLM_DIR.append(
            _build_vlm_dir(tmp_path_factory.mktemp("tiny_gemma3_vision_sft"), tokenizer)
        )
    return _VLM_DIR[0]


def _build_vlm_dir(path, tokenizer) -> str:
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    processor = _processor(tokenizer)
    tok = processor.tokenizer
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    vision_config = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=28, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision_config.to_dict(), mm_tokens_per_image=4,
        image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers zero-inits the projection and the norms
        for name, p in model.named_parameters():
            if "mm_input_projection" in name:
                p.normal_(0, 0.3)
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def _image(rng, size=(20, 24)):
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def _messages(n: int = 8, seed: int = 0, strings: bool = False):
    """Conversational rows with one or two images and answers of different lengths: the user
    turn's content lists `{"type": "image"}` parts then the text (TRL's vision format), or with
    `strings` is a plain string (the images then go before it)."""
    import datasets

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = 1 + i % 2
        question = f"{i}+{i}="
        answer = "".join(str(d) for d in rng.integers(0, 10, size=2 + i % 5))
        user = [{"type": "image"}] * k + [{"type": "text", "text": question}]
        reply = [{"type": "text", "text": answer}]
        if strings:
            user, reply = question, answer
        rows.append(
            {
                "images": [_image(rng) for _ in range(k)],
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": reply},
                ],
            }
        )
    return datasets.Dataset.from_list(rows)


def _prompt_completion(n: int = 8, seed: int = 1):
    import datasets

    rng = np.random.default_rng(seed)
    rows = [
        {
            "images": [_image(rng)],
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "completion": [{"role": "assistant", "content": str(i + 1) * (1 + i % 3)}],
        }
        for i in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def _trainers(vlm_dir, data, tmp_path, **args):
    import trl
    from transformers import AutoProcessor

    trl_trainer, theirs = trl_train_logs(
        trl.SFTTrainer, trl.SFTConfig, vlm_dir, AutoProcessor.from_pretrained(vlm_dir), data,
        tmp_path / "trl", **args,
    )  # fmt: skip
    ours = SFTTrainer(
        vlm_dir,
        args=SFTConfig(**base_args(tmp_path / "ours", **args)),
        train_dataset=data,
        processing_class=AutoProcessor.from_pretrained(vlm_dir),
    )
    ours.train()
    return ours, train_logs(ours), (trl_trainer, theirs)


@pytest.mark.parametrize(
    "make_data,args",
    [(_messages, {"max_length": 24}), (_prompt_completion, {"max_length": 17})],
    ids=["messages", "prompt_completion"],
)
def test_sft_matches_trl(vlm_dir, tmp_path, make_data, args):
    # One batch per epoch: each step sees the whole dataset (jaxrl's shuffle is not torch's).
    common = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3)
    data = make_data(4)
    ours, logs, (trl_trainer, theirs) = _trainers(vlm_dir, data, tmp_path, **common, **args)
    assert_logs_match(logs, theirs, METRICS, steps=2)
    if make_data is not _messages:
        return
    # The trained models evaluate alike, and save the same weights (vision tower included) in
    # transformers' layout.
    want, got = trl_trainer.evaluate(eval_dataset=data), ours.evaluate(eval_dataset=data)
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)
    trl_trainer.save_model(str(tmp_path / "trl_final"))
    ours.save_model(str(tmp_path / "ours_final"))
    theirs_w = load_file(tmp_path / "trl_final" / "model.safetensors")
    ours_w = load_file(tmp_path / "ours_final" / "model.safetensors")
    source = load_file(Path(vlm_dir) / "model.safetensors")
    assert set(ours_w) == set(theirs_w)
    for key in (
        "vision_tower.encoder.layers.1.mlp.fc2.weight",
        "multi_modal_projector.mm_input_projection_weight",
    ):
        assert not np.array_equal(theirs_w[key], source[key]), key  # trained
        np.testing.assert_allclose(ours_w[key], theirs_w[key], atol=1e-5, err_msg=key)
    assert (tmp_path / "ours_final" / "processor_config.json").exists()


def test_assistant_only_loss_matches_trl(vlm_dir, tmp_path):
    """With a template marking assistant turns, only they are trained (TRL's processor call
    with `return_assistant_tokens_mask`)."""
    template = tmp_path / "training.jinja"
    template.write_text(TRAINING_TEMPLATE)
    args = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3)
    args.update(assistant_only_loss=True, chat_template_path=str(template))
    ours, logs, (_, theirs) = _trainers(vlm_dir, _messages(4), tmp_path, **args)
    assert_logs_match(logs, theirs, METRICS, steps=2)
    mb = ours._collate([_messages(4)[0]])
    assert 0 < mb["loss_mask"].sum() < 10  # the answer and its end of turn


def test_collator_matches_trl(vlm_dir):
    """Our padded batch holds TRL's collated batch: ids, attention, labels, token types and
    pixel values row by row."""
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    processor = AutoProcessor.from_pretrained(vlm_dir)
    examples = [dict(ex) for ex in _messages(4, strings=True)]
    theirs = DataCollatorForVisionLanguageModeling(processor)([dict(ex) for ex in examples])
    collator = vision.VisionCollator(
        processor, kind="messages", max_length=None, completion_only_loss=False,
        dataset_text_field="text", max_images=2, image_token_id=processor.tokenizer.image_token_id,
        image_tokens=4,
    )  # fmt: skip
    ours = collator(examples, 48, processor.tokenizer.pad_token_id)
    t = theirs["input_ids"].shape[1]
    np.testing.assert_array_equal(ours["input_ids"][:, :t], theirs["input_ids"].numpy())
    np.testing.assert_array_equal(ours["attention_mask"][:, :t], theirs["attention_mask"].numpy())
    np.testing.assert_array_equal(ours["token_type_ids"][:, :t], theirs["token_type_ids"].numpy())
    labels = theirs["labels"].numpy()
    np.testing.assert_array_equal(ours["loss_mask"][:, : t - 1], labels[:, 1:] != -100)
    counts = [len(ex["images"]) for ex in examples]
    rows = np.concatenate([ours["pixel_values"][b, :k] for b, k in enumerate(counts)])
    np.testing.assert_allclose(rows, theirs["pixel_values"].numpy(), atol=1e-6)
    lengths = [collator.token_count(ex, k) for ex, k in zip(examples, counts, strict=True)]
    assert lengths == theirs["attention_mask"].sum(1).tolist()


def test_refusals(vlm_dir, tmp_path, hf_model_dir):
    from transformers import AutoProcessor

    from jaxrl.models import from_pretrained

    data = _messages(4)
    # One model for the trainers below (each refuses before training, so none changes it): a
    # trainer loading `vlm_dir` itself would trace and load the model again, eight times.
    vlm = from_pretrained(vlm_dir, vision=True)

    def make(model=vlm, **args):
        return SFTTrainer(
            model,
            args=SFTConfig(**base_args(tmp_path, **args)),
            train_dataset=data,
            processing_class=AutoProcessor.from_pretrained(vlm_dir),
        )

    for args, match in (
        ({"packing": True}, "packing=True is not supported for datasets with images"),
        ({"padding_free": True}, "padding_free=True is not supported for datasets with images"),
        ({"assistant_only_loss": True}, "needs a chat template that marks assistant turns"),
        ({"completion_only_loss": True}, "completion_only_loss=True on language-modelling"),
        ({"truncation_mode": "keep_end"}, "keep_end"),
        ({"max_length": 12}, "increase `max_length`"),
    ):
        with pytest.raises(ValueError, match=match):
            make(**args).train()
    data = _prompt_completion(4)
    with pytest.raises(ValueError, match="too short and causes image placeholder tokens"):
        make(max_length=5).train()
    with pytest.raises(ValueError, match="the model is not an image-text model"):
        make(hf_model_dir)
    with pytest.raises(ValueError, match="needs the model's processor"):
        SFTTrainer(
            vlm, args=SFTConfig(**base_args(tmp_path)), train_dataset=data,
            processing_class=AutoProcessor.from_pretrained(vlm_dir).tokenizer,
        )  # fmt: skip


def test_text_trainers_refuse_images(tmp_path, hf_model_dir, tokenizer):
    import datasets

    from jaxrl import RewardConfig, RewardTrainer

    rng = np.random.default_rng(0)
    pairs = datasets.Dataset.from_list(
        [{"images": [_image(rng)], "prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2
    )
    with pytest.raises(ValueError, match="'images' column but RewardTrainer trains on text only"):
        RewardTrainer(
            hf_model_dir, args=RewardConfig(**base_args(tmp_path)), train_dataset=pairs,
            processing_class=tokenizer,
        )  # fmt: skip


def test_lora_adapts_the_vision_tower_as_peft(vlm_dir, tmp_path):
    """PEFT's `q_proj` / `v_proj` / `fc1` targets adapt the SigLIP layers as well as the language
    model; the trained adapter file loads in PEFT, whose logits on the images are ours."""
    import peft
    import torch
    import transformers
    from transformers import AutoProcessor

    data = _messages(4)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "fc1"])
    ours = SFTTrainer(
        vlm_dir,
        args=SFTConfig(**base_args(tmp_path / "ours", per_device_train_batch_size=4, max_steps=2)),
        train_dataset=data,
        processing_class=AutoProcessor.from_pretrained(vlm_dir),
        peft_config=config,
    )
    ours.train()
    ours.save_model(str(tmp_path / "adapter"))
    mb = ours._collate([data[i] for i in range(4)])
    # One compiled forward (eagerly, each op of the model compiled its own program: ~170).
    got = np.asarray(
        jit_call(
            ours.current_model(),
            mb["input_ids"],
            pixel_values=mb["pixel_values"],
            token_type_ids=mb["token_type_ids"],
        )
    )
    pixels = np.concatenate([mb["pixel_values"][b, : len(data[b]["images"])] for b in range(4)])
    inputs = {
        "input_ids": torch.from_numpy(mb["input_ids"]).long(),
        "attention_mask": torch.from_numpy(mb["attention_mask"]).long(),
        "token_type_ids": torch.from_numpy(mb["token_type_ids"]).long(),
        "pixel_values": torch.from_numpy(pixels),
    }
    base = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    with torch.no_grad():
        before = base(**inputs).logits.numpy()
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        want = theirs(**inputs).logits.numpy()
    mask = mb["attention_mask"][..., None]
    assert any("vision_tower" in m for m in theirs.peft_config["default"].target_modules)
    assert np.max(np.abs(want - before) * mask) > 1e-4
    np.testing.assert_allclose(got * mask, want * mask, atol=1e-5)
