"""Lazy, one-tensor-at-a-time reading and streaming writing of HF weight files.

Readers return numpy arrays (bf16 via `ml_dtypes`, which numpy alone cannot represent, and which
is why safetensors files are memory-mapped here rather than read with `safe_open(framework="np")`).
The writer streams tensors into safetensors files so peak host memory stays about one tensor.
This file knows file formats only, not model layouts (that is `hf.py`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxrl.config_cli import MissingExtraError

SAFE_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NP_TO_SAFE = {v: k for k, v in SAFE_TO_NP.items()}


class WeightsFileError(ValueError):
    """A weight file is truncated or corrupt; the message names the file."""


def _corrupt(path: Path, what: str) -> WeightsFileError:
    return WeightsFileError(
        f"Weight file {path} is {what}. Re-download or re-save the checkpoint (an interrupted "
        "copy or download leaves such files)."
    )


class SafetensorsFile:
    """Memory-mapped safetensors file: `get(key)` reads only that tensor.

    The header is checked when the file is opened: every tensor's bytes must lie inside the
    file, so a truncated or corrupt file is one clear error naming it, before any tensor is read.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(self.path, f"truncated ({size} bytes, shorter than a header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise _corrupt(self.path, "corrupt or truncated (its header runs past the end)")
            try:
                header = json.loads(f.read(header_len))
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except (ValueError, UnicodeDecodeError) as err:
                raise _corrupt(self.path, f"corrupt (unreadable header: {err})") from err
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict[str, Any]] = header
        self.data_start = 8 + header_len
        for key, entry in self.entries.items():
            try:
                end = int(entry["data_offsets"][1])
                SAFE_TO_NP[entry["dtype"]]
            except (KeyError, TypeError, IndexError, ValueError) as err:
                raise _corrupt(self.path, f"corrupt (bad header entry for {key!r})") from err
            if self.data_start + end > size:
                raise _corrupt(
                    self.path,
                    f"truncated: {key!r} ends at byte {self.data_start + end} but the file has "
                    f"{size} bytes",
                )

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, key: str) -> np.ndarray:
        entry = self.entries[key]
        dtype = SAFE_TO_NP[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        mm = np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=self.data_start + begin,
            shape=(end - begin,),
        )
        return np.array(mm.view(dtype).reshape(shape))


class TorchBinFile:
    """A `pytorch_model.bin` shard, loaded with torch (imported lazily, mmap where possible)."""

    def __init__(self, path: Path):
        try:
            import torch
        except ImportError as err:
            raise MissingExtraError(
                f"{path} is a PyTorch .bin checkpoint, and reading it needs torch, which is not "
                "installed. Install the torch extra, `pip install 'jaxrl[torch]'` (without a GPU, "
                "first `pip install torch --index-url https://download.pytorch.org/whl/cpu`: the "
                "CPU-only build, without ~3 GB of CUDA libraries), or convert the checkpoint to "
                "safetensors."
            ) from err
        self._torch = torch
        try:
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, EOFError, OSError, ValueError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            raise _corrupt(Path(path), f"corrupt or truncated ({err})") from err

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, key: str) -> np.ndarray:
        t = self.tensors[key].detach().contiguous()
        if t.dtype == self._torch.bfloat16:
            return t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


class CheckpointReader:
    """All weight files of an HF directory behind one `key -> np.ndarray` lookup."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        files: list[Path]
        for index_name, single in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            index = directory / index_name
            if index.exists():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as err:
                    raise _corrupt(index, f"corrupt (no readable weight_map: {err})") from err
                files = [directory / name for name in dict.fromkeys(weight_map.values())]
                missing = [p.name for p in files if not p.exists()]
                if missing:
                    raise FileNotFoundError(
                        f"{index} lists weight files that are missing: {missing}. Download or "
                        "copy the complete checkpoint."
                    )
                break
            if (directory / single).exists():
                files = [directory / single]
                break
        else:
            raise FileNotFoundError(
                f"No weights found in {directory}: expected model.safetensors, "
                "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json."
            )
        self.files = [
            SafetensorsFile(p) if p.suffix == ".safetensors" else TorchBinFile(p) for p in files
        ]
        self.key_to_file = {k: f for f in self.files for k in f.keys()}

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def get(self, key: str) -> np.ndarray:
        return self.key_to_file[key].get(key)

    def spec(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """A weight's shape and dtype (from the safetensors header: nothing is read)."""
        file = self.key_to_file[key]
        if isinstance(file, SafetensorsFile):
            entry = file.entries[key]
            return tuple(entry["shape"]), np.dtype(SAFE_TO_NP[entry["dtype"]])
        x = file.get(key)
        return tuple(x.shape), x.dtype


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "10KiB"."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
    }
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(
        f"Cannot parse size {size!r}; use an int (bytes) or a string like '5GB' or '500MB'."
    )


def write_safetensors(
    path: Path,
    specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    fetch: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Stream tensors into one safetensors file: the header comes from `specs` (shape, dtype),
    then `fetch(key)` is called once per key, so only one tensor is in host memory at a time."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for key, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {
            "dtype": NP_TO_SAFE[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for key, (shape, dtype) in specs.items():
            array = np.ascontiguousarray(fetch(key), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"Tensor {key} has shape {array.shape}, expected {tuple(shape)}.")
            f.write(array.tobytes())


def plan_shards(
    specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], max_shard_bytes: int
) -> Iterator[list[str]]:
    """Group keys in order into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shard: list[str] = []
    size = 0
    for key, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = [], 0
        shard.append(key)
        size += nbytes
    if shard:
        yield shard
