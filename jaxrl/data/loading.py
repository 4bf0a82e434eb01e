"""Load a dataset from whatever the user passed as `--dataset_name`.

Accepts an in-memory `datasets.Dataset`/`DatasetDict`, a local `.json`/`.jsonl`/`.parquet`/`.csv`
file, a directory of such files, a `save_to_disk` directory, or a Hugging Face Hub id (only when
online). Never tokenizes; see `sft.py`, `preference.py`, `reward.py`.
"""

import os
from pathlib import Path
from typing import Any

import datasets

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _offline() -> bool:
    flags = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(v in ("1", "true", "yes", "on") for v in flags)


def _select_split(data: Any, split: str | None, source: str) -> Any:
    if split is None or not isinstance(data, datasets.DatasetDict):
        return data
    if split not in data:
        raise ValueError(
            f"Split {split!r} not found in {source}; available splits: {sorted(data)}. "
            "Set dataset_train_split / dataset_test_split to one of them."
        )
    return data[split]


def _load_files(files: list[Path], split: str | None, source: str, **kw: Any) -> Any:
    exts = {_BUILDERS[f.suffix.lower()] for f in files}
    if len(exts) > 1:
        raise ValueError(f"{source} mixes file types {sorted(exts)}; keep one format per dataset.")
    by_split: dict[str, list[str]] = {}
    for f in files:
        # `train.jsonl`, `test-00001.parquet`, ... name their split; anything else is "train".
        name = f.name.split(".")[0].split("-")[0].split("_")[0]
        key = name if name in ("train", "test", "validation", "eval") else "train"
        by_split.setdefault(key, []).append(str(f))
    data = datasets.load_dataset(exts.pop(), data_files=by_split, **kw)
    return _select_split(data, split, source)


def load_dataset_any(
    name_or_path: str | os.PathLike | datasets.Dataset | datasets.DatasetDict,
    split: str | None = "train",
    **kw: Any,
) -> datasets.Dataset | datasets.DatasetDict:
    """Return the `split` of a dataset (the whole `DatasetDict` when `split` is None).

    - `Dataset` objects are returned unchanged; a `DatasetDict` gives its `split`.
    - A single data file holds only the "train" split.
    - A directory of data files maps files named `train*`, `test*`, `validation*`, `eval*` to those
      splits (any other name counts as "train").
    - A `save_to_disk` directory is read with `datasets.load_from_disk`.
    - Anything else is treated as a Hub id; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) that is
      an error asking for a local path. `kw` is passed to `datasets.load_dataset`.
    """
    if isinstance(name_or_path, datasets.Dataset | datasets.DatasetDict):
        return _select_split(name_or_path, split, "the given DatasetDict")
    path = Path(os.path.expanduser(str(name_or_path)))
    source = str(name_or_path)
    if path.is_file():
        if path.suffix.lower() not in _BUILDERS:
            raise ValueError(
                f"Unsupported data file {source}: use .json, .jsonl, .parquet or .csv "
                "(or a save_to_disk directory)."
            )
        if split not in (None, "train"):
            raise ValueError(
                f"{source} is a single file, which holds only the 'train' split (asked for "
                f"{split!r}); pass the {split} file itself as the dataset for that split."
            )
        return _load_files([path], "train", source, **kw)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return _select_split(datasets.load_from_disk(str(path)), split, source)
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in _BUILDERS)
        if not files:
            raise ValueError(
                f"Directory {source} has no .json/.jsonl/.parquet/.csv files and is not a "
                "save_to_disk directory."
            )
        return _load_files(files, split, source, **kw)
    looks_local = source.startswith(("/", "./", "../", "~")) or path.suffix.lower() in _BUILDERS
    if looks_local:
        raise FileNotFoundError(f"Dataset path {source} does not exist.")
    if _offline():
        raise ValueError(
            f"{source!r} is not a local file or directory, and the Hugging Face Hub is offline "
            "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set). Pass a local path (.jsonl/.json/"
            ".parquet/.csv file, directory, or save_to_disk directory) as dataset_name."
        )
    try:
        return datasets.load_dataset(source, split=split, **kw)
    except (ConnectionError, OSError) as err:
        raise ValueError(
            f"Could not download {source!r} from the Hugging Face Hub ({err}). If you are offline, "
            "pass a local path as dataset_name."
        ) from err
