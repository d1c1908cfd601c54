"""Prompt data named by a Hugging Face Hub dataset id, read through ``datasets`` and the cache.

An entry of ``data.train_files`` / ``data.val_files`` that is no local path and reads

- ``org/name``: its ``train`` split (EasyR1's default);
- ``org/name@split``: EasyR1's spelling (``hiyouga/math12k@train``); a split expression as
  ``datasets`` takes it (``train[:1000]``, ``train+test``) works too;
- ``org/name:config@split``: a dataset with several configurations (``openai/gsm8k:main@test``);

is resolved with the models' rules (fitrl/core/hub.py: ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``,
``HF_TOKEN``). Offline (or with the Hub out of reach) the dataset's snapshot in the hub cache is
read as a local dataset directory: what ``hf download --repo-type dataset`` or an earlier online
``load_dataset`` left there. Online, ``datasets`` downloads what the split needs, at the commit
looked up once. Its config and split are checked before any row is read (one line naming the
ones it has), and its rows then go through the same checks as a local file's, each named
``org/name@split: row i`` (the entry spelt in full). A resumed run reads the commit its run
directory recorded (fitrl/models/hub.py). Arrow rows, as for a ``save_to_disk`` directory: an
Image column stays ``{"bytes", "path"}`` for the vision path to decode and check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from fitrl.core import hub
from fitrl.core.errors import DataError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
"""A missing entry ending so is a local file that is not there (``data file not found``), not a Hub id."""
DEFAULT_SPLIT = "train"


@dataclass(frozen=True)
class DatasetRef:
    repo: hub.HubRef
    config: Optional[str]
    split: str
    text: str
    """The entry as written."""

    @property
    def name(self) -> str:
        """The entry spelt in full (``org/name:config@split``): what each row's place starts with."""
        return f"{self.repo.repo_id}{':' + self.config if self.config else ''}@{self.split}"


@dataclass(frozen=True)
class DatasetSource:
    """A resolved dataset: where ``datasets`` reads it, at which commit, with which config."""

    ref: DatasetRef
    location: str
    """The snapshot directory in the hub cache, or the repository id (online: ``datasets`` downloads)."""
    commit: str
    config: Optional[str]

    @property
    def local(self) -> bool:
        return os.path.isdir(self.location)

    def record(self) -> dict:
        """What the run directory keeps of it (fitrl/models/hub.py, ``hub_refs.json``)."""
        return {"id": self.ref.repo.repo_id, "config": self.config, "split": self.ref.split, "commit": self.commit,
                "location": self.location}


def parse_dataset_ref(text: Optional[str]) -> Optional[DatasetRef]:
    """The Hub dataset ``text`` names; None for a local path.

    >>> r = parse_dataset_ref("openai/gsm8k:main@test")
    >>> r.repo.repo_id, r.config, r.split
    ('openai/gsm8k', 'main', 'test')
    >>> parse_dataset_ref("hiyouga/math12k").split, parse_dataset_ref("data/train.jsonl")
    ('train', None)
    """
    if not text:
        return None
    name, at, split = text.partition("@")
    repo, colon, config = name.partition(":")
    if (not hub.is_repo_id(repo) or repo.lower().endswith(LOCAL_SUFFIXES) or (at and not split.strip())
            or (colon and not config.strip()) or not hub.names_no_local_path(text, repo)):
        return None
    return DatasetRef(hub.HubRef(repo, None, "dataset"), config or None, split or DEFAULT_SPLIT, text)


_RESOLVED: dict[tuple, DatasetSource] = {}
"""Sources resolved in this process, by entry and environment: the start-up check and the rows
read later resolve each entry once (the rows are read in the driver, after the check)."""


def resolve_dataset(ref: DatasetRef, key: str = "data file", *, pin: Optional[str] = None,
                    fresh: bool = False) -> DatasetSource:
    """Where ``ref`` is read from, its config and split checked; ``key`` names the setting
    (``data.train_files[0]``). A one-line :class:`DataError` when it cannot be had. ``pin``: the
    commit to read (a resumed run's, from ``hub_refs.json``); ``fresh``: look the revision up
    again even if this process resolved the entry before (a run's start-up check does; the
    rows read after it take what the check resolved)."""
    memo = (ref.text, str(hub.hub_cache()), hub.offline_setting("dataset"))
    known = _RESOLVED.get(memo)
    if known is not None and not fresh and (pin is None or known.commit == pin):
        return known
    what = f"{key}={ref.text!r}"
    commit, names, _ = hub.lookup(ref.repo, what, pin)
    location = ref.repo.repo_id if names is not None else str(hub.snapshot_dir(ref.repo, commit))
    revision = commit if names is not None else None  # (a snapshot directory is read as it is)
    datasets = _datasets()
    configs = _ask(what, lambda: datasets.get_dataset_config_names(location, revision=revision))
    config = ref.config
    if config is not None and configs and config not in configs:
        raise DataError(f"{what}: {ref.repo.repo_id} has no config {config!r} (its configs: {', '.join(configs)}); "
                        f"write {ref.repo.repo_id}:{configs[0]}@{ref.split}")
    if config is None and len(configs) > 1 and "default" not in configs:
        raise DataError(f"{what}: {ref.repo.repo_id} has several configs ({', '.join(configs)}): name one, e.g. "
                        f"{ref.repo.repo_id}:{configs[0]}@{ref.split}")
    if config is None and len(configs) == 1:
        config = configs[0]
    splits = _ask(what, lambda: datasets.get_dataset_split_names(location, config, revision=revision,
                                                                 cache_dir=str(datasets_cache())))
    for part in ref.split.split("+"):
        name = part.split("[")[0].strip()
        if name not in splits:
            spelled = f"{ref.repo.repo_id}{':' + ref.config if ref.config else ''}@{splits[0] if splits else 'train'}"
            named = f" (config {config})" if config and (ref.config or len(configs) > 1) else ""
            raise DataError(f"{what}: {ref.repo.repo_id}{named} has no split {name!r} (its splits: "
                            f"{', '.join(splits) or 'none'}); write {spelled}")
    source = _RESOLVED[memo] = DatasetSource(ref, location, commit, config)
    return source


def hub_rows(ref: DatasetRef) -> Iterator[tuple[str, dict]]:
    """``(source, row)`` for every row of the dataset's split, as :func:`fitrl.data.rows.iter_rows` yields them."""
    source = resolve_dataset(ref)
    datasets = _datasets()
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # ("Generating train split" bars would interleave with the start-up lines)
    try:
        ds = _ask(ref.name, lambda: datasets.load_dataset(
            source.location, source.config, split=ref.split, revision=None if source.local else source.commit,
            cache_dir=str(datasets_cache())))
    finally:
        if shown:
            datasets.enable_progress_bars()
    i = 0
    for batch in ds.with_format("arrow").iter(batch_size=1000):
        for row in batch.to_pylist():
            yield f"{ref.name}: row {i}", row
            i += 1


def rows_dir(ref: DatasetRef) -> str:
    """Where relative image paths of the dataset's rows are read from: its snapshot directory."""
    source = resolve_dataset(ref)
    return source.location if source.local else os.getcwd()


def datasets_cache() -> Path:
    """``datasets``' own cache (its Arrow tables), from the environment as it is now: ``HF_DATASETS_CACHE``,
    else ``HF_HOME/datasets`` (``datasets`` computes it once, when it is imported)."""
    explicit = os.environ.get("HF_DATASETS_CACHE")
    return Path(os.path.expanduser(explicit)) if explicit else hub.hf_home() / "datasets"


def _datasets():
    import datasets  # (slow to import: only a Hub dataset needs it here)

    return datasets


def _ask(what: str, call) -> Any:
    """``call()`` with what ``datasets`` raises as one line."""
    try:
        return call()
    except DataError:
        raise
    except Exception as e:  # datasets raises ValueError, FileNotFoundError, DatasetNotFoundError, ...
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"{what}: datasets cannot read it: {type(e).__name__}: {first}") from None
