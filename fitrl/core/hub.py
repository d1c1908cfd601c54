"""Hugging Face Hub repositories named by their ids, resolved through the standard cache.

A model is named ``org/name`` or ``org/name@revision`` (a branch, a tag or a commit id, what
``from_pretrained(revision=...)`` takes, in the ``@`` spelling EasyR1's configs use); a dataset's
spelling (``org/name:config@split``) is fitrl/data/hub.py's. Either is a Hub id only when no local
path of that name exists, nor its first folder (``models/qwen`` beside a ``models/`` folder is a
misspelt local path, and says so).

What huggingface_hub reads is read here when a reference is resolved, not when huggingface_hub
was imported (a test, a notebook or ``fitrl.train`` may set it later):

- the cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
- offline: ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``; for datasets also
  ``HF_DATASETS_OFFLINE=1``): the cache only, nothing is downloaded;
- ``HF_TOKEN`` (or ``hf auth login``): gated and private repositories.

Online, the revision is looked up once (its commit, :func:`lookup`) and what the cache lacks of
that commit is downloaded into it; a Hub that cannot be reached is read as offline (the cache).
Every failure is one line, a :class:`~fitrl.core.errors.ModelDirError` for a model and a
:class:`~fitrl.core.errors.DataError` for a dataset (exit 2): the reference, the cache searched
and the ``hf download`` command that fills it. Standard library only until a reference is resolved.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

from fitrl.core.errors import DataError, ModelDirError, UserError

_PART = r"[A-Za-z0-9][\w.-]*"
REPO_ID = re.compile(rf"{_PART}/{_PART}")
"""``org/name`` as the Hub spells a repository (huggingface_hub's ``validate_repo_id`` rules)."""
TIMEOUT_S = 10.0
"""Seconds the revision look-up waits for the Hub (huggingface_hub's own default for its checks)."""
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "tokenizer.model")
"""A tokenizer's files (those a repository has): what the plan reads to sample prompt lengths
(fitrl/models/hub.py)."""
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""What is downloaded of a repository for its tokenizer alone: a run's ``tokenizer_path``
(fitrl/models/hub.py), a TRL reward's ``completion_ids`` outside a run (fitrl/rewards/python.py)."""
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubRef:
    """A repository on the Hub and the revision asked for (None: its default branch)."""

    repo_id: str
    revision: Optional[str] = None
    repo_type: str = "model"

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def url(self) -> str:
        return f"https://huggingface.co/{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"


@dataclass(frozen=True)
class Snapshot:
    """A resolved reference: the commit its revision names and that commit's directory in the cache."""

    ref: HubRef
    commit: str
    path: Path

    def record(self) -> dict:
        """What the run directory keeps of it (fitrl/models/hub.py, ``hub_refs.json``)."""
        return {"id": self.ref.repo_id, "revision": self.ref.revision or "main", "commit": self.commit,
                "path": str(self.path)}


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text and not text.endswith(".git")


def names_no_local_path(text: str, repo: str) -> bool:
    """``text`` (whose repository part is ``repo``) is no local path: neither it nor its first folder exists."""
    return not os.path.exists(text) and not os.path.exists(repo.split("/")[0])


def parse_model_ref(text: Optional[str]) -> Optional[HubRef]:
    """The Hub model ``text`` names (``org/name``, ``org/name@revision``); None for a local path.

    >>> parse_model_ref("Qwen/Qwen2.5-7B-Instruct@v1.0")
    HubRef(repo_id='Qwen/Qwen2.5-7B-Instruct', revision='v1.0', repo_type='model')
    >>> parse_model_ref("/data/Qwen2.5-7B-Instruct") is None, parse_model_ref(".cache/models/tiny") is None
    (True, True)
    """
    if not text:
        return None
    repo, at, revision = text.partition("@")
    if not is_repo_id(repo) or (at and not revision.strip()) or not names_no_local_path(text, repo):
        return None
    return HubRef(repo, revision or None)


# ----------------------------------------------------------------------------- the environment

def hub_cache() -> Path:
    """The cache huggingface_hub reads and fills, from the environment as it is now."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    return hf_home() / "hub"


def hf_home() -> Path:
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home)))


def offline_setting(repo_type: str = "model") -> Optional[str]:
    """The variable that says offline (``HF_HUB_OFFLINE=1``); None when downloads are allowed."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") + (("HF_DATASETS_OFFLINE",) if repo_type == "dataset" else ())
    for name in names:
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name}={os.environ[name]}"
    return None


def fill_command(ref: HubRef, files: Sequence[str] = ()) -> str:
    """The ``hf download`` command that puts ``ref`` (or only ``files`` of it) in this cache."""
    parts = ["hf", "download", ref.repo_id, *files]
    if ref.repo_type != "model":
        parts += ["--repo-type", ref.repo_type]
    if ref.revision:
        parts += ["--revision", ref.revision]
    cache = hub_cache()
    if cache != Path(os.path.expanduser(os.path.join("~", ".cache", "huggingface", "hub"))):
        parts += ["--cache-dir", str(cache)]
    return " ".join(parts)


def snapshot_dir(ref: HubRef, commit: str) -> Path:
    """Where the cache keeps ``commit`` of ``ref``'s repository (the hub's own layout)."""
    return hub_cache() / _repo_folder(ref) / "snapshots" / commit


def _repo_folder(ref: HubRef) -> str:
    return f"{ref.repo_type}s--{ref.repo_id.replace('/', '--')}"  # huggingface_hub's repo_folder_name


# ----------------------------------------------------------------------------- resolving

def lookup(ref: HubRef, what: str, pin: Optional[str] = None, needed: Sequence[str] = ()
           ) -> tuple[str, Optional[list[str]], str]:
    """``(commit, the files of that commit on the Hub, why offline)`` of ``ref``: the files are
    None when the commit came from the cache alone (offline, or the Hub out of reach: ``why``
    says which). ``pin``: a commit to use instead of the revision's head (a resumed run's).
    ``what`` starts every message (``actor.model.path='Qwen/Qwen2.5-7B'``); ``needed``: the files
    the caller reads, when not the whole repository (the ``hf download`` command names them)."""
    why = offline_setting(ref.repo_type)
    if why is None:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        try:
            info = HfApi().repo_info(ref.repo_id, repo_type=ref.repo_type, revision=pin or ref.revision,
                                     timeout=TIMEOUT_S)
            return info.sha, [s.rfilename for s in info.siblings or []], ""
        except GatedRepoError:
            raise _error(ref, f"{what}: {ref.repo_id} is gated on the Hub and {_token_text()}: accept its terms at "
                              f"{ref.url}, then log in (`hf auth login`) or set HF_TOKEN") from None
        except RevisionNotFoundError:
            asked = f"commit {pin} (recorded by this run directory)" if pin else f"revision {ref.revision!r}"
            raise _error(ref, f"{what}: {ref.repo_id} has no {asked} on the Hub: name a branch, a tag or a commit "
                              f"id it has (e.g. {ref.repo_id}@main){_hub_refs(ref)}") from None
        except RepositoryNotFoundError:
            raise _error(ref, f"{what}: {ref.repo_id} is not on the Hub, or is private and {_token_text()} (check "
                              f"the spelling at {ref.url}; a private repository needs `hf auth login` or "
                              f"HF_TOKEN)") from None
        except Exception as e:
            if not _unreachable(e):
                raise
            why = f"the Hub could not be reached ({type(e).__name__})"
    return _cached_commit(ref, what, pin, why, needed), None, why


def snapshot(ref: HubRef, what: str, *, pin: Optional[str] = None, allow: Optional[Sequence[str]] = None,
             ignore: Union[Sequence[str], Callable[[list[str]], Sequence[str]], None] = None
             ) -> tuple[Snapshot, Optional[list[str]]]:
    """``ref`` as a directory in the cache, its files (matching ``allow``, not ``ignore``:
    fnmatch patterns, or a function of the repository's file names giving them) downloaded
    when online; returns the snapshot and the Hub's file list (None when offline: the
    directory holds what the cache has)."""
    commit, names, _ = lookup(ref, what, pin)
    if names is None:
        return Snapshot(ref, commit, snapshot_dir(ref, commit)), None
    from huggingface_hub import snapshot_download

    if callable(ignore):
        ignore = ignore(names)
    try:
        path = snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=commit, cache_dir=str(hub_cache()),
                                 allow_patterns=list(allow) if allow else None,
                                 ignore_patterns=list(ignore) if ignore else None)
    except Exception as e:  # a network cut or a full disk half-way: the cache keeps what was whole
        raise _error(ref, f"{what}: downloading {ref} into {hub_cache()} failed ({type(e).__name__}: "
                          f"{_first_line(e)}); run it again, or `{fill_command(ref)}`") from None
    return Snapshot(ref, commit, Path(path)), names


def files(ref: HubRef, what: str, required: Sequence[str], optional: Sequence[str] = (), *,
          pin: Optional[str] = None) -> Snapshot:
    """Only ``required`` (each one a one-line error when missing) and whichever of ``optional``
    the repository has, in the cache: what ``fitrl plan`` reads of a model, never its weights."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    commit, names, why = lookup(ref, what, pin, required)
    for name in [*required, *optional]:
        needed = name in required
        if names is not None and name not in names:
            if needed:
                raise _error(ref, f"{what}: {ref.repo_id} has no {name} on the Hub (at {commit[:8]}), so it is not "
                                  f"a Hugging Face {ref.repo_type} fitrl reads")
            continue
        try:
            hf_hub_download(ref.repo_id, name, repo_type=ref.repo_type, revision=commit, cache_dir=str(hub_cache()),
                            local_files_only=names is None)
        except EntryNotFoundError:  # (LocalEntryNotFoundError is one: offline, this commit lacks the file)
            if needed:
                raise _error(ref, f"{what}: the Hugging Face cache {hub_cache()} holds {ref} at {commit[:8]} "
                                  f"without {name}, and {why} (nothing is downloaded); fill it where the Hub is "
                                  f"reachable: `{fill_command(ref, [name])}`") from None
        except Exception as e:
            if needed:
                raise _error(ref, f"{what}: downloading {name} of {ref} failed ({type(e).__name__}: "
                                  f"{_first_line(e)}); `{fill_command(ref, [name])}`") from None
    return Snapshot(ref, commit, snapshot_dir(ref, commit))


def _cached_commit(ref: HubRef, what: str, pin: Optional[str], why: str, needed: Sequence[str] = ()) -> str:
    """The commit the cache holds for ``ref``'s revision (or ``pin``), else the one-line reason."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return Path(snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=pin or ref.revision,
                                      cache_dir=str(cache), local_files_only=True)).name
    except LocalEntryNotFoundError:
        pass
    fill = (f"fill it where the Hub is reachable: `{fill_command(ref, needed)}` (`huggingface-cli download` before "
            f"huggingface_hub 1.0)")
    root = cache / _repo_folder(ref)
    if not root.is_dir():
        raise _error(ref, f"{what}: no local path of that name, and {ref} is not in the Hugging Face cache {cache} "
                          f"({why}: nothing is downloaded); {fill}")
    asked = f"commit {pin} (recorded by this run directory)" if pin else f"revision {ref.revision or 'main'!r}"
    held = ", ".join(f"{name} -> {commit[:8]}" for name, commit in _cached_refs(root).items()) or "no revision"
    raise _error(ref, f"{what}: {asked} of {ref.repo_id} is not in the Hugging Face cache {cache} (it holds {held}) "
                      f"and {why}: name a revision it holds, or {fill}")


def _cached_refs(root: Path) -> dict[str, str]:
    """Revision name -> commit, as the cache's ``refs/`` records them, and snapshots no name points at."""
    found = {}
    refs = root / "refs"
    for f in sorted(refs.rglob("*")) if refs.is_dir() else []:
        if f.is_file():
            found[str(f.relative_to(refs))] = f.read_text().strip()
    named = set(found.values())
    for snap in sorted((root / "snapshots").iterdir()) if (root / "snapshots").is_dir() else []:
        if snap.name not in named:
            found[snap.name[:8]] = snap.name
    return found


def _hub_refs(ref: HubRef) -> str:
    """``; its branches: main; tags: v1.0`` (best effort: a look-up that fails says nothing)."""
    try:
        from huggingface_hub import HfApi

        refs = HfApi().list_repo_refs(ref.repo_id, repo_type=ref.repo_type)
        branches, tags = [b.name for b in refs.branches][:8], [t.name for t in refs.tags][:8]
    except Exception:
        return ""
    return f"; its branches: {', '.join(branches) or 'none'}; tags: {', '.join(tags) or 'none'}"


def _token_text() -> str:
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception:
        token = None
    return "the token in use (HF_TOKEN or `hf auth login`) has no access" if token else "no token is set"


def _unreachable(e: BaseException) -> bool:
    """A connection that failed (no network, DNS, a proxy, a timeout, a Hub down): not an answer."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return status is not None and status >= 500
    return any(c.__name__ in ("TransportError", "RequestError") for c in type(e).__mro__)


def _error(ref: HubRef, message: str) -> UserError:
    return (DataError if ref.repo_type == "dataset" else ModelDirError)(message)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


# ----------------------------------------------------------------------------- a cache from local files

def cache_repo(repo_id: str, contents: Mapping[str, Union[bytes, str, Path]], *, repo_type: str = "model",
               revision: str = "main", commit: Optional[str] = None, cache: Optional[Path] = None) -> Snapshot:
    """Put ``contents`` (path in the repository -> bytes, text or a local file) into the cache as
    ``commit`` of ``repo_id`` with ``revision`` naming it, in the layout ``hf download`` writes
    (``blobs/<sha256>``, ``snapshots/<commit>/<path>`` linking to them, ``refs/<revision>``):
    how the tests and the docs' examples build a cache without a network. ``commit`` defaults
    to a digest of the contents."""
    cache = Path(cache) if cache is not None else hub_cache()
    blobs = {name: (Path(data).read_bytes() if isinstance(data, Path) else
                    data.encode() if isinstance(data, str) else bytes(data)) for name, data in contents.items()}
    if commit is None:
        digest = hashlib.sha1()
        for name in sorted(blobs):
            digest.update(name.encode() + b"\0" + hashlib.sha256(blobs[name]).digest())
        commit = digest.hexdigest()
    ref = HubRef(repo_id, revision, repo_type)
    root = cache / _repo_folder(ref)
    snap = root / "snapshots" / commit
    for name, data in blobs.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return Snapshot(ref, commit, snap)
