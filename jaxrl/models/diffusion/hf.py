"""Diffusers pipeline directories <-> jaxrl's Stable Diffusion models.

A pipeline directory holds `unet/`, `vae/`, `text_encoder/`, `tokenizer/` and `scheduler/`; each
model folder has a config.json and weights (`diffusion_pytorch_model.*` for diffusers models,
`model.*` for the transformers text encoder; safetensors, sharded safetensors or PyTorch .bin).
Models are built abstractly, every param gets its NamedSharding from its logical axes, and each
checkpoint tensor is read alone and placed straight into its shards. Our module names mirror
diffusers'/transformers', so a param path maps to a PyTorch key mechanically (`kernel`/`scale`/
`embedding` -> `weight`); conv kernels are HWIO here and OIHW in PyTorch, linear kernels [in, out]
here and [out, in] there.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import parallel
from jaxrl.models.diffusion.clip import CLIPConfig, CLIPTextModel, CLIPVisionModelWithProjection
from jaxrl.models.diffusion.unet import UNet2DConditionModel, UNetConfig
from jaxrl.models.diffusion.vae import AutoencoderKL, VAEConfig
from jaxrl.models.weights_io import SafetensorsFile, TorchBinFile, write_safetensors

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
TRANSFORMERS_WEIGHTS = "model"
TRANSFORMERS_BIN = "pytorch_model"
# Pre-0.14 diffusers checkpoints name the VAE attention projections differently.
LEGACY_VAE_NAMES = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
# Buffers some checkpoints carry (transformers 4.x CLIP position ids), never parameters.
IGNORED_SUFFIXES = ("position_ids",)
CLIP_TEXT_PARTS = ("text_model.", "text_projection.", "logit_scale")
CLIP_VISION_PARTS = ("vision_model.", "visual_projection.", "logit_scale")


class WeightFiles:
    """Every weight file of one model folder behind a `key -> np.ndarray` lookup."""

    def __init__(self, directory: Path, stems: tuple[str, ...]):
        self.directory = Path(directory)
        candidates = []
        for stem in stems:
            for ext in ("safetensors", "bin"):
                candidates += [f"{stem}.{ext}.index.json", f"{stem}.{ext}"]
        for name in candidates:
            path = self.directory / name
            if not path.exists():
                continue
            if name.endswith(".index.json"):
                weight_map = json.loads(path.read_text())["weight_map"]
                files = [self.directory / f for f in dict.fromkeys(weight_map.values())]
            else:
                files = [path]
            break
        else:
            raise FileNotFoundError(
                f"No weights in {self.directory}: expected one of {', '.join(candidates)}."
            )
        opened = [
            SafetensorsFile(f) if f.suffix == ".safetensors" else TorchBinFile(f) for f in files
        ]
        self.key_to_file = {k: f for f in opened for k in f.keys()}

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def get(self, key: str) -> np.ndarray:
        return self.key_to_file[key].get(key)


def torch_key(path: tuple) -> str:
    """PyTorch state-dict key of one of our params (its nnx flat-state path)."""
    leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight"}.get(path[-1], path[-1])
    return ".".join([*(str(p) for p in path[:-1]), leaf])


def torch_to_ours(x: np.ndarray, path: tuple) -> np.ndarray:
    if path[-1] == "kernel" and x.ndim == 4:
        return x.transpose(2, 3, 1, 0)  # OIHW -> HWIO
    if path[-1] == "kernel":
        return x.T  # nn.Linear [out, in] -> [in, out]
    return x


def ours_to_torch(x: np.ndarray, path: tuple) -> np.ndarray:
    if path[-1] == "kernel" and x.ndim == 4:
        return x.transpose(3, 2, 0, 1)
    if path[-1] == "kernel":
        return x.T
    return x


def _shardings(abstract_state: Any, mesh: Mesh | None, rules: parallel.Rules | None) -> Any:
    if mesh is None:
        single = Mesh(np.array(jax.devices()[:1]), ("data",))
        replicated = NamedSharding(single, PartitionSpec())
        return jax.tree.map(
            lambda _: replicated, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    return parallel.param_shardings(abstract_state, mesh, rules)


def _read(files: WeightFiles, key: str, legacy_vae: bool) -> tuple[str, np.ndarray] | None:
    if key in files:
        return key, files.get(key)
    # transformers >= 5 saves CLIPTextModel without the `text_model.` prefix that SD checkpoints
    # (and CLIPModel) have.
    head, _, rest = key.partition(".")
    if head == "text_model" and rest in files:
        return rest, files.get(rest)
    if legacy_vae:
        for new, old in LEGACY_VAE_NAMES.items():
            alt = key.replace(f".{new}.", f".{old}.")
            if alt != key and alt in files:
                x = files.get(alt)
                # Some old checkpoints store these projections as 1x1 convs.
                return alt, x.reshape(x.shape[:2]) if x.ndim == 4 else x
    return None


def load_weights(
    create: Callable[[], nnx.Module],
    files: WeightFiles,
    *,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
    key_prefix: str = "",
    legacy_vae: bool = False,
    other_parts: tuple[str, ...] = (),
) -> nnx.Module:
    """`create()`'s module with every param read from `files` (key = `key_prefix` + our path),
    checked for shape and placed into its sharding one tensor at a time. Checkpoint tensors left
    unused trigger a warning, except buffers and keys starting with one of `other_parts` (the
    other tower of a CLIPModel checkpoint)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(create))
    flat_shardings = dict(nnx.to_flat_state(_shardings(abstract, mesh, rules)))
    loaded = []
    used: set[str] = set()
    for path, variable in nnx.to_flat_state(abstract):
        path = tuple(path)
        key = key_prefix + torch_key(path)
        found = _read(files, key, legacy_vae)
        if found is None:
            raise KeyError(
                f"{files.directory} has no weight '{key}' (config.json and the weights disagree, "
                "or the checkpoint is incomplete)."
            )
        used.add(found[0])
        x = torch_to_ours(found[1], path)
        if tuple(x.shape) != tuple(variable.shape):
            raise ValueError(
                f"Shape mismatch for '{key}' in {files.directory}: checkpoint gives "
                f"{tuple(x.shape)} (after layout conversion), the model built from config.json "
                f"expects {tuple(variable.shape)}."
            )
        x = np.asarray(x, dtype=variable.dtype)
        value = jax.make_array_from_callback(x.shape, flat_shardings[path], lambda i, x=x: x[i])
        loaded.append((path, variable.replace(value=value)))
    unused = sorted(
        k
        for k in set(files.keys()) - used
        if not k.startswith(other_parts) and not k.endswith(IGNORED_SUFFIXES)
    )
    if unused:
        warnings.warn(
            f"{files.directory} has {len(unused)} weight(s) the model does not use: "
            f"{', '.join(unused[:20])}{' ...' if len(unused) > 20 else ''}",
            stacklevel=2,
        )
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} has no config.json; is it a diffusers model folder?")
    return json.loads(path.read_text())


def load_unet(
    directory: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
) -> UNet2DConditionModel:
    """A diffusers `unet/` folder as a sharded `UNet2DConditionModel` (f32 by default)."""
    directory = Path(directory)
    config = UNetConfig.from_diffusers(_config(directory))
    dtype = dtype or np.float32
    param_dtype = param_dtype or np.float32

    def create():
        return UNet2DConditionModel(config, nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)

    files = WeightFiles(directory, (DIFFUSERS_WEIGHTS,))
    return load_weights(create, files, mesh=mesh, rules=rules)


def load_vae(
    directory: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
) -> AutoencoderKL:
    """A diffusers `vae/` folder as a sharded `AutoencoderKL`."""
    directory = Path(directory)
    config = VAEConfig.from_diffusers(_config(directory))

    def create():
        return AutoencoderKL(
            config, nnx.Rngs(0), dtype=dtype or np.float32, param_dtype=param_dtype or np.float32
        )

    files = WeightFiles(directory, (DIFFUSERS_WEIGHTS,))
    return load_weights(create, files, mesh=mesh, rules=rules, legacy_vae=True)


def load_clip_text(
    directory: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
) -> CLIPTextModel:
    """A transformers CLIPTextModel folder (SD's `text_encoder/`)."""
    directory = Path(directory)
    config = CLIPConfig.from_hf(_config(directory), "text")

    def create():
        return CLIPTextModel(
            config, nnx.Rngs(0), dtype=dtype or np.float32, param_dtype=param_dtype or np.float32
        )

    files = WeightFiles(directory, (TRANSFORMERS_WEIGHTS, TRANSFORMERS_BIN))
    return load_weights(create, files, mesh=mesh, rules=rules, other_parts=CLIP_VISION_PARTS)


def load_clip_vision(
    directory: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
) -> CLIPVisionModelWithProjection:
    """The image tower + projection of a CLIPModel or CLIPVisionModelWithProjection folder
    (e.g. openai/clip-vit-large-patch14 for the aesthetic reward)."""
    directory = Path(directory)
    config = CLIPConfig.from_hf(_config(directory), "vision")

    def create():
        return CLIPVisionModelWithProjection(
            config, nnx.Rngs(0), dtype=dtype or np.float32, param_dtype=param_dtype or np.float32
        )

    files = WeightFiles(directory, (TRANSFORMERS_WEIGHTS, TRANSFORMERS_BIN))
    return load_weights(create, files, mesh=mesh, rules=rules, other_parts=CLIP_TEXT_PARTS)


@dataclasses.dataclass
class StableDiffusion:
    """The pieces of a diffusers Stable Diffusion pipeline directory."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: Any
    scheduler_config: dict[str, Any]


def load_pipeline(
    path: str | Path,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    mesh: Mesh | None = None,
    rules: parallel.Rules | None = None,
) -> StableDiffusion:
    """Load `unet/`, `vae/`, `text_encoder/`, `tokenizer/` and `scheduler/` of a pipeline dir."""
    import transformers

    path = Path(path)
    fix = (
        "Pass a Stable Diffusion 1.x/2.x pipeline saved by diffusers "
        "(StableDiffusionPipeline.save_pretrained: unet/, vae/, text_encoder/, tokenizer/, "
        "scheduler/), or leave --pretrained_model unset for the tiny random pipeline."
    )
    if not path.is_dir():
        what = (
            "is a file, not a directory"
            if path.exists()
            else "does not exist (a Hub pipeline is read from a local copy: `hf download ID "
            "--local-dir DIR`)"
        )
        raise FileNotFoundError(f"pretrained_model {str(path)!r} {what}. {fix}")
    missing = [
        d
        for d in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
        if not (path / d).is_dir()
    ]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a diffusers Stable Diffusion directory: missing "
            f"{', '.join(d + '/' for d in missing)}. {fix}"
        )
    kw = dict(dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules)
    scheduler_file = path / "scheduler" / "scheduler_config.json"
    return StableDiffusion(
        unet=load_unet(path / "unet", **kw),
        vae=load_vae(path / "vae", **kw),
        text_encoder=load_clip_text(path / "text_encoder", **kw),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path / "tokenizer"),
        scheduler_config=json.loads(scheduler_file.read_text()),
    )


def save_weights(
    module: nnx.Module,
    path: Path,
    filename: str,
    *,
    key_prefix: str = "",
    skip: Callable[[tuple], bool] = lambda path: False,
) -> None:
    """Stream `module`'s params (PyTorch layout and keys) into one safetensors file; tensors are
    gathered one at a time and only process 0 writes (every process must call this)."""
    flat = {
        tuple(p): v
        for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))
        if not skip(tuple(p))
    }
    specs, by_key = {}, {}
    for p, v in flat.items():
        shape = tuple(v.shape)
        torch_shape = (
            shape[::-1]
            if p[-1] == "kernel" and len(shape) == 2
            else ((shape[3], shape[2], shape[0], shape[1]) if p[-1] == "kernel" else shape)
        )
        key = key_prefix + torch_key(p)
        specs[key] = (torch_shape, np.dtype(v.dtype))
        by_key[key] = p

    def fetch(key: str) -> np.ndarray:
        p = by_key[key]
        return ours_to_torch(parallel.to_host(flat[p][...]), p)

    if jax.process_index() == 0:
        path.mkdir(parents=True, exist_ok=True)
        write_safetensors(path / filename, specs, fetch, metadata={"format": "pt"})
    else:
        for key in specs:
            fetch(key)


def save_unet(unet: UNet2DConditionModel, path: str | Path) -> None:
    """Write a diffusers `unet/` folder (config.json + diffusion_pytorch_model.safetensors) that
    `diffusers.UNet2DConditionModel.from_pretrained` loads with the same outputs."""
    path = Path(path)
    # LoRA params live on the UNet but are exported separately (`lora.save_lora_weights`).
    save_weights(
        unet,
        path,
        f"{DIFFUSERS_WEIGHTS}.safetensors",
        skip=lambda p: "lora" in p,
    )
    if jax.process_index() == 0:
        config = dict(unet.config.raw) or _default_unet_config(unet.config)
        (path / "config.json").write_text(json.dumps(config, indent=2))


def _default_unet_config(cfg: UNetConfig) -> dict[str, Any]:
    return {
        "_class_name": "UNet2DConditionModel",
        "in_channels": cfg.in_channels,
        "out_channels": cfg.out_channels,
        "down_block_types": list(cfg.down_block_types),
        "up_block_types": list(cfg.up_block_types),
        "block_out_channels": list(cfg.block_out_channels),
        "layers_per_block": cfg.layers_per_block,
        "cross_attention_dim": cfg.cross_attention_dim,
        "attention_head_dim": list(cfg.num_heads),
        "transformer_layers_per_block": list(cfg.transformer_layers_per_block),
        "use_linear_projection": cfg.use_linear_projection,
        "upcast_attention": cfg.upcast_attention,
        "norm_num_groups": cfg.norm_num_groups,
        "norm_eps": cfg.norm_eps,
        "flip_sin_to_cos": cfg.flip_sin_to_cos,
        "freq_shift": cfg.freq_shift,
        "sample_size": cfg.sample_size,
    }
