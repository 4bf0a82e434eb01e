"""HF checkpoints <-> jaxrl models: `from_pretrained`, `from_config`, `save_pretrained`.

Params are created or loaded directly into their sharding: the model is built abstractly
(`nnx.eval_shape`), each param's NamedSharding comes from its logical axes and the rules, and each
checkpoint tensor is read lazily and placed straight into its shards. Which checkpoint key and
layout each param has is `hf_keys.py`. This file knows no adapters: LoRA on a loaded model and
TRL's value-head loader with PEFT options are `jaxrl.lora`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import types
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import parallel
from jaxrl.models import hf_keys, mxfp4
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import FAMILIES, family
from jaxrl.models.gpt2 import GPT2ForCausalLM
from jaxrl.models.gpt_oss import GptOssForCausalLM
from jaxrl.models.heads import (
    CAUSAL_LMS,
    CausalLMWithValueHead,
    SequenceClassificationModel,
    value_head_init,
)
from jaxrl.models.hf_config import config_from_hf
from jaxrl.models.llama import LlamaForCausalLM
from jaxrl.models.vision import Gemma3ForConditionalGeneration
from jaxrl.models.weights_io import CheckpointReader, parse_size, plan_shards, write_safetensors

TASKS = ("causal_lm", "sequence_classification", "causal_lm_with_value_head")
# TRL's AutoModelForCausalLMWithValueHead keys: the LM's own keys plus these.
V_HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")
# Checkpoint entries that are buffers or derived values, never parameters.
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
Model = (
    LlamaForCausalLM
    | GPT2ForCausalLM
    | GptOssForCausalLM
    | SequenceClassificationModel
    | CausalLMWithValueHead
)


# ---------------------------------------------------------------- building


def build_model(
    config: ModelConfig,
    rngs: nnx.Rngs,
    task: str,
    num_labels: int,
    value_head_kwargs: dict[str, Any] | None = None,
) -> Model:
    """A freshly initialised model for `config` and `task` (use under `nnx.eval_shape` or jit).

    `value_head_kwargs` (task "causal_lm_with_value_head"): TRL's `summary_dropout_prob`,
    `v_head_init_strategy`, `v_head_initializer_range`."""
    if config.vision is not None:
        if task != "causal_lm":
            raise ValueError(
                f"vision=True supports task='causal_lm' only (got {task!r}); load the model "
                "without vision for other tasks (it then trains on text)."
            )
        return Gemma3ForConditionalGeneration(config, rngs)
    if task == "causal_lm_with_value_head":
        return CausalLMWithValueHead(config, rngs, **(value_head_kwargs or {}))
    if task == "sequence_classification":
        return SequenceClassificationModel(config, rngs, num_labels=num_labels)
    return CAUSAL_LMS[family(config.model_type).decoder](config, rngs)


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not supported; use one of {TASKS}.")


def _num_labels(hf_config: Any, task: str, num_labels: int | None) -> int:
    if num_labels is not None:
        return num_labels
    archs = getattr(hf_config, "architectures", None) or []
    if task == "sequence_classification" and any("SequenceClassification" in a for a in archs):
        return hf_config.num_labels
    return 1


def unsharded_placement() -> NamedSharding:
    """Where a model loaded without a mesh keeps its params (adapters added later too): the
    first device, as a one-device mesh, so every param has the same kind of sharding and a
    jitted call's outputs come back placed as its inputs were (no recompile on the next call)."""
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())


def place(value: Any, axes: tuple, config: ModelConfig) -> jax.Array:
    """`value` placed as a param with logical `axes` of a model of `config` is: on its mesh by
    its sharding rules, or, loaded without a mesh, at `unsharded_placement()` (parameters added
    or replaced after loading: LoRA adapters, resized token tables)."""
    if config.mesh is None:
        return jax.device_put(value, unsharded_placement())
    spec = parallel.logical_to_spec(axes, config.rules, value.shape, config.mesh)
    return jax.device_put(value, NamedSharding(config.mesh, spec))


def _shardings(abstract_state: Any, mesh: Mesh | None, rules: parallel.Rules | None) -> Any:
    if mesh is None:
        replicated = unsharded_placement()
        return jax.tree.map(
            lambda _: replicated, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    return parallel.param_shardings(abstract_state, mesh, rules)


def _prepare_hf_config(hf_config: Any, task: str, num_labels: int) -> Any:
    hf_config = copy.deepcopy(hf_config)
    if task == "sequence_classification":
        model_type = getattr(hf_config, "model_type", None)
        fam = FAMILIES.get(model_type)
        if fam is not None and fam.hf_seq_cls_arch is None:
            with_one = [t for t, f in FAMILIES.items() if f.hf_seq_cls_arch]
            raise ValueError(
                f"task='sequence_classification' is not supported for {model_type}: transformers "
                "has no sequence-classification class for it, so the model could not be saved "
                f"as one. Families with one: {', '.join(with_one)}."
            )
        hf_config.num_labels = num_labels
    return hf_config


def from_config(
    hf_config: Any,
    *,
    seed: int = 0,
    dtype: Any = None,
    param_dtype: Any = None,
    residual_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
    scan_layers: bool = False,
    remat_policy: str = "none",
    task: str = "causal_lm",
    num_labels: int | None = None,
    attention_impl: str | None = None,
    value_head_kwargs: dict[str, Any] | None = None,
    vision: bool = False,
    activation_offloading: bool = False,
    require_trained_head: bool = False,
) -> Model:
    """Randomly initialised model (normal(0, initializer_range) weights, as HF), created sharded.
    The weights depend on `seed` only, not on `scan_layers`: an unrolled stack is the scanned one
    cut into layers. `vision=True` (image-text configs): with the vision tower and projector
    (`from_pretrained`)."""
    _check_task(task)
    mesh = None if mesh is None else parallel.normalize_mesh(mesh, rules)
    labels = _num_labels(hf_config, task, num_labels)
    config = config_from_hf(
        _prepare_hf_config(hf_config, task, labels),
        dtype=dtype,
        param_dtype=param_dtype,
        residual_dtype=residual_dtype,
        scan_layers=scan_layers,
        remat_policy=remat_policy,
        attention_impl=attention_impl,
        mesh=mesh,
        rules=rules,
        vision=vision,
        activation_offloading=activation_offloading,
    )

    def create(config: ModelConfig = config) -> Model:
        return build_model(config, nnx.Rngs(seed), task, labels, value_head_kwargs)

    graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
    shardings = _shardings(abstract_state, mesh, rules)
    if config.scan_layers:
        # Each device computes only its shards: jit with out_shardings never builds the full model.
        state = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
    else:
        state = _unstacked_init(create, config, abstract_state, shardings, mesh, rules)
    return nnx.merge(graphdef, state)


def _unstacked_init(
    create: Any,
    config: ModelConfig,
    abstract_state: Any,
    shardings: Any,
    mesh: Mesh | None,
    rules: Any,
) -> Any:
    """The state of an unrolled model (`scan_layers=False`), initialised as the scanned model
    from the same seed and cut into layers: a random init written layer by layer is one program
    that grows with depth, and XLA:GPU took 202 s to compile it for a 24-layer model (its sibling
    fusions merge every layer's random-number kernels into one), the scanned init 3 s. An
    unrolled model therefore has the same weights as the scanned one."""
    scanned_config = dataclasses.replace(config, scan_layers=True)
    _, scanned_abstract = nnx.split(nnx.eval_shape(lambda: create(scanned_config)))
    scanned_shardings = _shardings(scanned_abstract, mesh, rules)
    scanned = jax.jit(
        lambda: nnx.split(create(scanned_config))[1], out_shardings=scanned_shardings
    )()
    scanned = dict(nnx.to_flat_state(scanned))
    values, layer_slices = {}, collections.defaultdict(list)
    for path, sharding in nnx.to_flat_state(shardings):
        stack = next(
            (i for i in range(len(path) - 1)
             if hf_keys.is_layer_stack(path[i]) and isinstance(path[i + 1], int)
             and path[0] not in hf_keys.VISION_MODULES),
            None,
        )  # fmt: skip
        if stack is None:
            values[path] = scanned.pop(path).get_value()
        else:
            source = path[: stack + 1] + path[stack + 2 :]
            layer_slices[source].append((path, path[stack + 1], sharding))
    for source, slices in layer_slices.items():
        stacked = scanned.pop(source).get_value()
        if isinstance(stacked, jax.core.Tracer):  # under a trace (e.g. `nnx.eval_shape`)
            values.update((path, stacked[layer]) for path, layer, _ in slices)
            continue
        for path, layer, sharding in slices:
            values[path] = _layer_slice(sharding)(stacked, layer)
        stacked.delete()  # peak memory: the model plus one stacked parameter
    return nnx.from_flat_state(
        [(p, v.replace(value=values[p])) for p, v in nnx.to_flat_state(abstract_state)]
    )


@functools.cache
def _layer_slice(sharding: NamedSharding) -> Any:
    """`stacked[i]` placed with `sharding` (one compile per shape and sharding, not per layer)."""
    return jax.jit(
        lambda stacked, i: jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False),
        out_shardings=sharding,
    )


# ---------------------------------------------------------------- loading


def resolve_checkpoint_dir(path_or_hub_id: str | Path) -> Path:
    """A local directory as is; otherwise a Hub id downloaded (or found) in the HF cache."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"{path} is a file; pass the directory that holds config.json and the weights."
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(path_or_hub_id),
                allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"],
            )
        )
    except Exception as err:
        raise FileNotFoundError(
            f"Could not find model '{path_or_hub_id}': it is not a local directory and the "
            f"Hugging Face Hub download failed ({type(err).__name__}: {err}). Check the name, "
            "your network / HF_HUB_OFFLINE setting, or pass a local directory."
        ) from err


def adapter_base_model(path: str | Path) -> str | None:
    """The base model a PEFT adapter directory names (`adapter_config.json`'s
    `base_model_name_or_path`), or None when `path` is not a local adapter directory (it holds a
    full model's config.json, or no adapter_config.json). An adapter that names no base model is
    a ValueError."""
    directory = Path(path).expanduser()
    config_file = directory / "adapter_config.json"
    if not config_file.is_file() or (directory / "config.json").exists():
        return None
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except ValueError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}).") from err
    if not base:
        raise ValueError(
            f"{directory} is a PEFT adapter whose {config_file.name} names no base model "
            "(base_model_name_or_path is empty): set it to the base model's directory or Hub id, "
            "or load them yourself: lora.load_peft_adapter(models.from_pretrained(BASE), "
            f"{str(directory)!r})."
        )
    return str(base)


class MissingWeightError(KeyError, ValueError):
    """A weight the config needs is not in the checkpoint (a ValueError too: bad user input)."""

    def __str__(self) -> str:  # KeyError would print the message as a quoted repr
        return str(self.args[0])


def _read_param(
    entry: hf_keys.ParamEntry, reader: CheckpointReader, config: ModelConfig, source: str
) -> np.ndarray:
    """Our (stacked, for scanned layers) host array for one param, in the param dtype."""
    out = np.empty(entry.variable.shape, config.param_dtype)
    for index, key in zip(entry.indices(), entry.keys(), strict=True):
        found = hf_keys.lookup_key(key, reader, config)
        if found is None:
            raise MissingWeightError(
                f"{source} has no weight '{key}' needed by {config.model_type} "
                f"(config and weights disagree, or the checkpoint is incomplete). Use the "
                "config.json that came with these weights, or re-download the checkpoint."
            )
        x = reader.get(found)
        if tuple(x.shape) != tuple(entry.hf_shape):
            raise ValueError(
                f"Shape mismatch for '{key}': {source} has {tuple(x.shape)}, the "
                f"model built from its config expects {tuple(entry.hf_shape)}."
            )
        # Filled in place so a scanned stack costs one stacked tensor of host memory.
        target = out[index]
        target[...] = hf_keys.hf_to_ours(x, entry.path, entry.layer_shape, config, entry.layout)
    return out


def _place(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    # Each device receives only its slice of the host array.
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def from_pretrained(
    path_or_hub_id: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    residual_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
    scan_layers: bool = False,
    remat_policy: str = "none",
    task: str = "causal_lm",
    num_labels: int | None = None,
    attention_impl: str | None = None,
    value_head_kwargs: dict[str, Any] | None = None,
    vision: bool = False,
    activation_offloading: bool = False,
    require_trained_head: bool = False,
) -> Model:
    """Load an HF checkpoint directory (or Hub id) into a sharded jaxrl model.

    Image-text checkpoints (Gemma 3's `Gemma3ForConditionalGeneration`): by default the language
    model alone is loaded (text-only training; the vision weights are copied through unchanged
    by `save_pretrained`); `vision=True` loads the vision tower and projector as params too, and
    the model takes `pixel_values` (`jaxrl.models.vision`), trains them and saves them.

    `dtype="bfloat16"` over f32 params is torch autocast (bf16 matmuls, f32 residual stream);
    `residual_dtype` overrides the residual dtype (see `config_from_hf`).

    For `task="sequence_classification"` from a causal-LM checkpoint the score head is freshly
    initialised (as transformers does), with `num_labels` (default 1); with
    `require_trained_head=True` (a reward model used to score) that is a ValueError instead. For
    `task="causal_lm_with_value_head"` the value head is read from TRL's `v_head.summary.*` keys
    when the checkpoint has them, else initialised as TRL does (`value_head_kwargs`, plus an
    optional `seed` for that init).
    """
    import transformers

    _check_task(task)
    directory = resolve_checkpoint_dir(path_or_hub_id)
    config_file = directory / "config.json"
    base = adapter_base_model(directory)
    if base is not None:
        raise ValueError(
            f"{directory} is a PEFT adapter (adapter_config.json) for the base model {base!r}, "
            "not a full model. The trainers built on Trainer (SFT, reward, DPO, GRPO, RLOO) load "
            "such a directory as PEFT's AutoPeftModel classes do, the base and then the adapter; "
            "here do the same: lora.load_peft_adapter(models.from_pretrained("
            f"{base!r}), {str(directory)!r}), or merge the adapter into its base first "
            "(PeftModel.merge_and_unload) and pass the merged directory."
        )
    if not config_file.exists():
        raise FileNotFoundError(f"{directory} has no config.json; is it an HF model directory?")
    model_type = json.loads(config_file.read_text()).get("model_type")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(directory)
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"model_type={model_type!r} in {config_file} is not supported by jaxrl.models "
            f"(transformers could not read it: {err})."
        ) from err
    return from_state(
        hf_config,
        CheckpointReader(directory),
        source=f"Checkpoint {directory}",
        passthrough_dir=directory,
        dtype=dtype,
        param_dtype=param_dtype,
        residual_dtype=residual_dtype,
        mesh=mesh,
        rules=rules,
        scan_layers=scan_layers,
        remat_policy=remat_policy,
        task=task,
        num_labels=num_labels,
        attention_impl=attention_impl,
        value_head_kwargs=value_head_kwargs,
        vision=vision,
        activation_offloading=activation_offloading,
        require_trained_head=require_trained_head,
    )


def from_state(
    hf_config: Any,
    reader: Any,
    *,
    source: str,
    passthrough_dir: Path | None = None,
    dtype: Any = None,
    param_dtype: Any = None,
    residual_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
    scan_layers: bool = False,
    remat_policy: str = "none",
    task: str = "causal_lm",
    num_labels: int | None = None,
    attention_impl: str | None = None,
    value_head_kwargs: dict[str, Any] | None = None,
    vision: bool = False,
    activation_offloading: bool = False,
    require_trained_head: bool = False,
) -> Model:
    """`from_pretrained` from an HF config and a `key -> np.ndarray` reader of HF-named weights
    (`keys()`, `in`, `get`: a checkpoint directory's, or a transformers model's state dict held
    in memory, `jaxrl.models.hf_objects`). `source` names the weights in messages ("Checkpoint
    DIR"); `passthrough_dir` is the directory an image-text model's vision weights are copied
    from when it is saved."""
    _check_task(task)
    mesh = None if mesh is None else parallel.normalize_mesh(mesh, rules)
    labels = _num_labels(hf_config, task, num_labels)
    config = config_from_hf(
        _prepare_hf_config(hf_config, task, labels),
        dtype=dtype,
        param_dtype=param_dtype,
        residual_dtype=residual_dtype,
        scan_layers=scan_layers,
        remat_policy=remat_policy,
        attention_impl=attention_impl,
        mesh=mesh,
        rules=rules,
        vision=vision,
        activation_offloading=activation_offloading,
    )
    # The released GPT-OSS checkpoints' MXFP4 expert weights are read dequantized.
    reader = mxfp4.dequantizing_reader(reader, hf_config, config.param_dtype)
    if config.language_model_prefix and passthrough_dir is not None:
        config = dataclasses.replace(config, passthrough_dir=str(passthrough_dir))

    head_kwargs = dict(value_head_kwargs or {})
    head_seed = head_kwargs.pop("seed", 0)

    def create() -> Model:
        return build_model(config, nnx.Rngs(0), task, labels, head_kwargs)

    graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
    shardings = _shardings(abstract_state, mesh, rules)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    fresh_head = task == "sequence_classification" and "score.weight" not in reader
    if fresh_head and require_trained_head:
        raise ValueError(
            f"{source} has no trained score head ('score.weight' is not in its weights: it "
            f"is a {type(hf_config).__name__.removesuffix('Config')} causal LM, not a reward "
            "model), so its scores would be random numbers. Train a reward model from it first "
            f"(python -m jaxrl.train --algo reward --model_name_or_path {passthrough_dir or 'MODEL'} "
            "--dataset_name PREFERENCE_DATA) and pass that run's final/ directory."
        )
    fresh_v_head = task == "causal_lm_with_value_head" and not all(k in reader for k in V_HEAD_KEYS)
    if fresh_v_head:
        v_kernel, v_bias = value_head_init(
            jax.random.key(head_seed),
            config.hidden_size,
            config.param_dtype,
            head_kwargs.get("v_head_init_strategy"),
            head_kwargs.get("v_head_initializer_range", 0.2),
        )
    used: set[str] = set()
    loaded = []
    for entry in hf_keys.entries(abstract_state, config):
        sharding = flat_shardings[entry.path]
        if fresh_head and entry.path[0] == "score":
            init = functools.partial(
                nnx.initializers.normal(config.initializer_range),
                jax.random.key(0),
                entry.variable.shape,
                config.param_dtype,
            )
            value = jax.jit(init, out_shardings=sharding)()
            warnings.warn(
                f"{source} has no 'score.weight': the score head ({labels} labels) is newly "
                "initialised; train it before use.",
                stacklevel=3,
            )
        elif fresh_v_head and entry.path[0] == "v_head":
            host = v_kernel if entry.path[-1] == "kernel" else v_bias
            value = _place(np.asarray(host), sharding)
        else:
            value = _place(_read_param(entry, reader, config, source), sharding)
            used.update(hf_keys.lookup_key(k, reader, config) for k in entry.keys())
        loaded.append((entry.path, entry.variable.replace(value=value)))
    own = {hf_keys.disk_key(k, config) for k in used}
    _warn_unused(
        set(reader.keys()) - used - set(_passthrough_keys(config, reader, own)),
        config,
        task,
        source,
    )
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _passthrough_keys(
    config: ModelConfig, reader: CheckpointReader, own: set[str] = frozenset()
) -> list[str]:
    """An image-text checkpoint's weights outside its language model and heads that the model
    does not hold (`own`: its params' checkpoint keys): the vision tower and projector of a
    text-only load, SigLIP's unused pooling head of a `vision=True` one. jaxrl does not run
    them and `save_pretrained` writes them back unchanged."""
    if not config.language_model_prefix:
        return []
    lm = ("language_model.", config.language_model_prefix + ".", "lm_head.", "score.", "v_head.")
    return sorted(
        k for k in reader.keys() if not k.startswith(lm) and hf_keys.disk_key(k, config) not in own
    )


def _warn_unused(unused: set[str], config: ModelConfig, task: str, source: str) -> None:
    expected = {"lm_head.weight"} if (config.tie_word_embeddings or task != "causal_lm") else set()
    unused = sorted(k for k in unused if k not in expected and not k.endswith(IGNORED_KEY_SUFFIXES))
    if unused:
        warnings.warn(
            f"{source} has {len(unused)} weight(s) the model does not use: "
            f"{', '.join(unused[:20])}{' ...' if len(unused) > 20 else ''}",
            stacklevel=4,
        )


# ---------------------------------------------------------------- saving


def save_pretrained(model: Model, path: str | Path, *, max_shard_size: int | str = "5GB") -> None:
    """Write an HF directory (config.json + safetensors, sharded with an index above
    `max_shard_size`) that transformers loads with the same logits. Tensors are gathered one at a
    time; only process 0 writes (every process must call this, for the gathers)."""
    config: ModelConfig = model.config
    task = (
        "sequence_classification" if isinstance(model, SequenceClassificationModel) else "causal_lm"
    )
    path = Path(path)
    write = jax.process_index() == 0
    state = nnx.state(model)
    entries = hf_keys.entries(state, config)
    dtype = np.dtype(config.param_dtype)
    specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    key_to_entry: dict[str, tuple[hf_keys.ParamEntry, tuple[int, ...]]] = {}
    for entry in entries:
        for index, key in zip(entry.indices(), entry.keys(), strict=True):
            key = hf_keys.disk_key(key, config)
            specs[key] = (tuple(entry.hf_shape), dtype)
            key_to_entry[key] = (entry, index)

    passthrough = _passthrough_reader(config)
    copied = _passthrough_keys(config, passthrough, set(specs)) if passthrough else []
    for key in copied:
        specs[key] = passthrough.spec(key)
    if passthrough and path.resolve() == Path(config.passthrough_dir).resolve():
        # Saving over the checkpoint it came from: read the copied weights before overwriting.
        kept = {k: passthrough.get(k) for k in copied}
        passthrough = types.SimpleNamespace(get=kept.__getitem__)

    cache: dict[tuple, np.ndarray] = {}

    def fetch(key: str) -> np.ndarray:
        if key not in key_to_entry:  # an image-text model's vision weight, copied through
            return passthrough.get(key)
        entry, index = key_to_entry[key]
        if entry.path not in cache:  # a stacked param is gathered once, kept for its layers
            cache.clear()
            cache[entry.path] = parallel.to_host(entry.variable[...])
        x = cache[entry.path][index]
        return hf_keys.ours_to_hf(x, entry.path, entry.hf_shape, config, entry.layout)

    shards = list(plan_shards(specs, parse_size(max_shard_size)))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    if write:
        path.mkdir(parents=True, exist_ok=True)
        _write_config(config, task, model, path)
    for name, keys in zip(names, shards, strict=True):
        shard_specs = {k: specs[k] for k in keys}
        if write:
            write_safetensors(path / name, shard_specs, fetch, metadata={"format": "pt"})
        else:
            for k in keys:  # other processes join the collective gathers
                fetch(k)
    if write and len(shards) > 1:
        total = sum(int(np.prod(s)) * d.itemsize for s, d in specs.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _passthrough_reader(config: ModelConfig) -> CheckpointReader | None:
    """The checkpoint an image-text model was loaded from, to copy its vision weights from."""
    if not config.language_model_prefix:
        return None
    if config.passthrough_dir is None:
        if config.vision is not None:  # the vision weights are the model's own
            return None
        warnings.warn(
            f"This {hf_keys.checkpoint_model_type(config)} model was not loaded from a checkpoint, "
            "so there are no vision-tower weights to save with it: transformers will initialise "
            "them randomly when it loads the saved model.",
            stacklevel=3,
        )
        return None
    directory = Path(config.passthrough_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"Cannot save this {hf_keys.checkpoint_model_type(config)} model: its vision-tower "
            f"weights are copied from the checkpoint it was loaded from, {directory}, which no "
            "longer exists. Restore that directory (or load the model again from a copy) before "
            "saving."
        )
    return CheckpointReader(directory)


def _write_config(config: ModelConfig, task: str, model: Model, path: Path) -> None:
    hf_config = copy.deepcopy(config.hf_config)
    fam = family(hf_keys.checkpoint_model_type(config))
    seq_cls = task == "sequence_classification"
    hf_config.architectures = [fam.hf_seq_cls_arch if seq_cls else fam.hf_causal_arch]
    if task == "sequence_classification":
        hf_config.num_labels = model.num_labels
    hf_config.dtype = str(jnp.dtype(config.param_dtype))
    # Weights are written dequantized (what transformers writes for an MXFP4 checkpoint loaded
    # with `Mxfp4Config(dequantize=True)`): no quantization_config.
    if getattr(hf_config, "quantization_config", None) is not None:
        del hf_config.quantization_config
    hf_config.save_pretrained(path)
