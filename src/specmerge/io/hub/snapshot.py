"""A Hugging Face hub repository fetched into the local cache: only the files a merge reads.

:func:`fetch_snapshot` resolves ``repo_id`` at a revision (branch, tag, full or unique short commit) to its cache
snapshot folder ``<cache>/models--ORG--NAME/snapshots/<commit>/`` with ``huggingface_hub.snapshot_download``
(the client's own cache layout, refs, tree cache and offline behaviour), asking only for :func:`needed_files`:
the weights in one format (the files :func:`specmerge.io.formats.sources.open_source` would pick, shards named by an
index added once the index is read), config and tokenizer/processor files, a PEFT adapter's files, README.md.
Online, the repository's file list is read first to choose the weight format; offline (``offline=True``, or the
hub unreachable), the cached tree listing or the snapshot's own files stand in for it. Every failure is one
:class:`HubError` line naming the id, the revision, the cache folder and what to do. ``huggingface_hub`` is
imported only here, when an id is resolved.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from specmerge.io.formats import names as formats
from specmerge.io.formats.files import folder_file
from specmerge.io.formats.protocol import SourceError
from specmerge.io.output.model_files import MODEL_FILE_PATTERNS, WEIGHT_PATTERNS, is_weight_file

README = "README.md"  # the model card: its front matter may state the license
SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")
FULL_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(SourceError):
    """A hub id cannot be resolved (not cached offline, not found, gated, no such revision, ...); one line."""


@dataclass(frozen=True)
class Snapshot:
    """A repository's cache snapshot folder, its commit, and why the cache was used without asking the hub."""

    folder: Path
    commit: str
    offline_reason: str | None = None  # None: the hub was asked (the files are its current ones)


def needed_files(files: Collection[str]) -> list[str]:
    """The files of a repository (paths as the hub lists them) that a merge reads, weights in one format.

    Top-level files only: a PEFT adapter's ``adapter_config.json`` and weights (safetensors preferred) when the
    repository is an adapter (as :func:`specmerge.io.views.experts.open_expert` decides); otherwise the weights that
    :func:`specmerge.io.formats.sources.open_source` would open (the safetensors index, ``model.safetensors``, the
    PyTorch index, ``pytorch_model.bin``, a single other safetensors index or file, in that order). Shards named
    by an index are not included: read the index, then ask for :func:`index_shards`. Plus the config, generation,
    tokenizer, processor, chat-template and remote-code files (``MODEL_FILE_PATTERNS``) and README.md. A
    repository with no weights specmerge reads gives only the other files (the reader then says what is missing).
    """
    top = sorted(f for f in files if "/" not in f)
    names = set(top)
    if formats.ADAPTER_CONFIG in names:
        weights = [formats.ADAPTER_CONFIG, *[f for f in formats.ADAPTER_FILES if f in names][:1]]
    else:
        weights = _weight_files(top)
    extra = [
        f
        for f in top
        if f not in weights
        and not is_weight_file(f)
        and (f == README or any(fnmatch.fnmatchcase(f, p) for p in MODEL_FILE_PATTERNS))
    ]
    return weights + extra


def _weight_files(top: list[str]) -> list[str]:
    names = set(top)
    for preferred in (formats.SAFETENSORS_INDEX, formats.SAFETENSORS_FILE, formats.TORCH_INDEX, formats.TORCH_FILE):
        if preferred in names:
            return [preferred]
    indexes = [f for f in top if f.endswith(formats.SAFETENSORS_INDEX_SUFFIX)]
    singles = [f for f in top if f.endswith(formats.SAFETENSORS_SUFFIX)]
    if len(indexes) == 1:
        return indexes
    if not indexes and len(singles) == 1:
        return singles
    return []  # none, or ambiguous: open_source says which


def index_shards(folder: Path, files: Iterable[str]) -> list[str]:
    """The shard file names that the index files among ``files`` in ``folder`` name (plain names only); an index
    that cannot be read safely or parsed is skipped (opening the checkpoint then says what is wrong with it)."""
    shards: dict[str, None] = {}
    for name in files:
        if not name.endswith(".index.json"):
            continue
        try:
            real = folder_file(folder / name, folder)
            weight_map = json.loads(real.read_text(encoding="utf-8")).get("weight_map")
        except (SourceError, OSError, ValueError, AttributeError, RecursionError):
            continue
        if isinstance(weight_map, dict):
            for shard in weight_map.values():
                if isinstance(shard, str) and shard not in ("", ".", "..") and not re.search(r"[/\\\0]", shard):
                    shards[shard] = None
    return list(shards)


def exact_patterns(files: Iterable[str]) -> list[str]:
    """``allow_patterns`` that match exactly these file names (fnmatch's ``*``, ``?`` and ``[`` escaped)."""
    return [re.sub(r"([*?\[])", r"[\1]", f) for f in files]


def fetch_snapshot(
    repo_id: str, revision: str | None, *, cache: Path, offline: bool, endpoint: str | None, quiet: bool
) -> Snapshot:
    """The cache snapshot of ``repo_id`` at ``revision`` (None: the default branch) holding :func:`needed_files`,
    downloaded into ``cache`` unless ``offline`` (then only the cache is read, as with ``HF_HUB_OFFLINE=1``).

    The client reads ``HF_HUB_OFFLINE`` once, when it is imported; ``offline`` (the variable as it is now) is
    what it follows during this call."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = offline
    try:
        return _fetch(repo_id, revision, cache=cache, offline=offline, endpoint=endpoint, quiet=quiet)
    finally:
        constants.HF_HUB_OFFLINE = saved


def _fetch(
    repo_id: str, revision: str | None, *, cache: Path, offline: bool, endpoint: str | None, quiet: bool
) -> Snapshot:
    import huggingface_hub as hub
    from huggingface_hub import errors

    where = Where(repo_id, expand_short_commit(cache, repo_id, revision), cache, offline)
    reason = "HF_HUB_OFFLINE is set" if offline else None
    refused: Exception | None = None  # what the hub answered, said if the cache does not have the repository
    if reason is None:
        try:
            info = hub.HfApi(endpoint=endpoint).model_info(repo_id, revision=where.revision)  # one request, no retries
            files = [f.rfilename for f in info.siblings or ()]
        except _connection_errors() as err:
            reason = f"the hub could not be reached ({type(err).__name__})"
        except errors.RevisionNotFoundError as err:
            raise where.error(err) from None
        except errors.HfHubHTTPError as err:  # not found, private, down: what is cached may do, as for the client
            refused, reason = err, f"the hub answered {getattr(err.response, 'status_code', '?')}"
        except Exception as err:
            raise where.error(err) from None
    if reason is None:  # online: the files the repository has at the revision decide what to download
        needed = needed_files(files)
        folder = _download(where, needed, endpoint, quiet, reason)
        shards = [s for s in index_shards(folder, needed) if s in set(files)]
        if shards:
            folder = _download(where.at(folder.name), shards, endpoint, quiet, reason)
        return Snapshot(folder, folder.name)
    # offline: the cached tree listing (the repository's files when it was downloaded) or the snapshot's files
    check_ref(cache, repo_id, where.revision)
    try:
        folder = _download(where, [], endpoint, quiet, reason)
    except HubError:
        if refused is None:
            raise
        raise where.error(refused) from None
    tree = _cached_tree(repo_id, folder, cache)
    files = _listing(folder) if tree is None else tree
    if not any(is_weight_file(f) for f in files if "/" not in f):
        raise where.no_checkpoint(folder, reason, listed=tree is not None)
    needed = needed_files(files)
    missing = [f for f in needed if not os.path.lexists(folder / f)]  # listed by the tree cache, never downloaded
    if not missing:
        _download(where.at(folder.name), needed, endpoint, quiet, reason)  # the client's own check of the snapshot
        missing = [s for s in index_shards(folder, needed) if not os.path.lexists(folder / s)]
    if missing:
        raise where.incomplete(folder, missing, reason)
    return Snapshot(folder, folder.name, reason)


@dataclass(frozen=True)
class Where:
    """A repository and revision looked for, and the cache: what every error message names."""

    repo_id: str
    revision: str | None
    cache: Path
    offline: bool

    def at(self, commit: str) -> Where:
        """The same repository at ``commit`` (the error messages then name the commit)."""
        return Where(self.repo_id, commit, self.cache, self.offline)

    @property
    def shown(self) -> str:
        return self.repo_id + (f" at revision '{self.revision}'" if self.revision else "")

    @property
    def download(self) -> str:
        rev = f" --revision {self.revision}" if self.revision else ""
        return f"`{hub_cli()} download {self.repo_id}{rev}`"

    @property
    def login(self) -> str:
        return "hf auth login" if hub_cli() == "hf" else "huggingface-cli login"

    def no_checkpoint(self, folder: Path, reason: str, *, listed: bool) -> HubError:
        """The line for a cached snapshot without weights: downloaded without them, or (``listed``: the cache's
        listing of the repository's files has none either) of a repository that holds none."""
        if listed:
            return HubError(
                f"Hugging Face hub id {self.shown}: the repository holds no checkpoint at commit {folder.name} (no "
                f"{', '.join(WEIGHT_PATTERNS)} file in the cache's listing of its files): give a repository with "
                "its weights"
            )
        return HubError(
            f"Hugging Face hub id {self.shown}: the cached snapshot {folder} holds no checkpoint (its weights were "
            f"not downloaded), and {reason}: download it with {self.download}"
            + (", or unset HF_HUB_OFFLINE" if self.offline else "")
        )

    def incomplete(self, folder: Path, missing: list[str], reason: str) -> HubError:
        """The line for a cached snapshot that lacks files a merge reads (and the hub is not asked)."""
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return HubError(
            f"Hugging Face hub id {self.shown}: the cached snapshot {folder} lacks {len(missing)} file(s) a merge "
            f"reads ({shown}), and {reason}: download them with {self.download}"
            + (", or unset HF_HUB_OFFLINE" if self.offline else "")
        )

    def error(self, err: BaseException, reason: str | None = None) -> HubError:
        """One line for what ``huggingface_hub`` raised."""
        from huggingface_hub import errors

        url = f"https://huggingface.co/{self.repo_id}"
        if isinstance(err, getattr(errors, "IncompleteSnapshotError", ())):
            return HubError(
                f"Hugging Face hub id {self.shown}: the cached snapshot {err.snapshot_path} lacks files a merge "
                f"needs ({_first_sentence(err)}), and {reason or 'the hub was not asked'}: download them with "
                f"{self.download}" + (", or unset HF_HUB_OFFLINE" if self.offline else "")
            )
        if isinstance(err, errors.LocalEntryNotFoundError):
            how = "unset HF_HUB_OFFLINE to download it" if self.offline else "check the network connection"
            return HubError(
                f"Hugging Face hub id {self.shown} is not in the cache {self.cache} and "
                f"{reason or 'the hub was not asked'}: download it with {self.download}, or {how}"
            )
        if isinstance(err, errors.GatedRepoError):
            return HubError(
                f"Hugging Face hub id {self.repo_id} is a gated repository: accept its conditions on {url} with your "
                f"account, then log in (`{self.login}`) or set HF_TOKEN"
            )
        if isinstance(err, errors.RepositoryNotFoundError):
            return HubError(
                f"Hugging Face hub id {self.repo_id}: no such model repository on the hub (or a private one your "
                f"token cannot read): check the id, log in (`{self.login}`) or set HF_TOKEN; a local folder of that "
                "name would be used instead"
            )
        if isinstance(err, errors.RevisionNotFoundError):
            return HubError(
                f"Hugging Face hub id {self.repo_id} has no revision '{self.revision}' (a branch, tag or commit): "
                f"see {url}/tree/main for its branches and {url}/commits/main for its commits"
            )
        if isinstance(err, errors.HfHubHTTPError):
            status = getattr(getattr(err, "response", None), "status_code", "?")
            return HubError(f"Hugging Face hub id {self.shown}: the hub answered {status} ({_first_sentence(err)})")
        if isinstance(err, errors.HFValidationError):
            return HubError(f"'{self.repo_id}' is not a valid Hugging Face hub id: {_first_sentence(err)}")
        if isinstance(err, OSError | ValueError | _connection_errors()):
            return HubError(
                f"Hugging Face hub id {self.shown}: cannot download it into {self.cache} "
                f"({type(err).__name__}: {_first_sentence(err)}); check the connection and the disk, or set "
                "HF_HUB_OFFLINE=1 to use what is cached"
            )
        raise err


def _download(where: Where, files: list[str], endpoint: str | None, quiet: bool, reason: str | None) -> Path:
    """``snapshot_download`` of exactly ``files`` (from the cache only when ``reason`` says why the hub is not
    asked); its errors as one HubError line."""
    import huggingface_hub as hub

    try:
        folder = hub.snapshot_download(
            where.repo_id,
            revision=where.revision,
            cache_dir=where.cache,
            local_files_only=reason is not None,
            allow_patterns=exact_patterns(files),
            endpoint=endpoint,
            token=None,  # the client finds HF_TOKEN or the token file
            tqdm_class=_silent_tqdm() if quiet else None,
        )
    except Exception as err:
        raise where.error(err, reason) from None
    return Path(folder)


def hub_cli() -> str:
    """The command line tool the installed ``huggingface_hub`` provides: ``hf`` (0.34 and later; 1.0 dropped the
    older one), else ``huggingface-cli``."""
    from importlib import metadata

    scripts = {e.name for e in metadata.entry_points(group="console_scripts") if e.value.startswith("huggingface_hub")}
    return "huggingface-cli" if "huggingface-cli" in scripts and "hf" not in scripts else "hf"


def repo_cache_folder(cache: Path, repo_id: str) -> Path:
    """The folder of model repository ``repo_id`` in the hub cache ``cache``: ``models--ORG--NAME``."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def check_ref(cache: Path, repo_id: str, revision: str | None) -> None:
    """Refuse a cached ``refs/<revision>`` (``main`` by default) that is not a commit hash: a corrupt cache entry,
    which the hub client blames on the revision ("no such revision")."""
    ref = repo_cache_folder(cache, repo_id) / "refs" / (revision or "main")
    if not ref.is_file() or ref.is_symlink():
        return
    try:
        text = ref.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return
    if not FULL_COMMIT.fullmatch(text):
        raise HubError(
            f"{repo_id}: the cache's {ref} holds {text[:60]!r}, not a commit hash: the cache entry is corrupt; delete "
            f"that file and download the repository again (`{hub_cli()} download {repo_id}`)"
        )


def expand_short_commit(cache: Path, repo_id: str, revision: str | None) -> str | None:
    """``revision`` as the full commit hash when it is a short one (7 to 39 hex digits, not a branch or tag
    cached under ``refs/``) that starts exactly one cached snapshot's commit; otherwise as given."""
    if revision is None or not SHORT_COMMIT.fullmatch(revision):
        return revision
    repo = repo_cache_folder(cache, repo_id)
    if os.path.lexists(repo / "refs" / revision):
        return revision
    try:
        matches = [c for c in os.listdir(repo / "snapshots") if c.startswith(revision) and FULL_COMMIT.fullmatch(c)]
    except OSError:
        return revision
    return matches[0] if len(matches) == 1 else revision


def _listing(folder: Path) -> list[str]:
    """The files of a snapshot folder, as repository paths (links included, not followed)."""
    found = []
    for root, dirs, names in os.walk(folder):
        rel = Path(root).relative_to(folder)
        found += [(rel / n).as_posix() for n in names]
        found += [(rel / d).as_posix() for d in dirs if os.path.islink(os.path.join(root, d))]
    return sorted(found)


def _cached_tree(repo_id: str, folder: Path, cache: Path) -> list[str] | None:
    """The repository's files at the snapshot's commit from the client's cached tree listing (huggingface_hub
    2.4 and later keep one), or None."""
    import huggingface_hub as hub

    read = getattr(hub, "get_cached_repo_tree", None)
    try:
        return None if read is None else [f.path for f in read(repo_id, revision=folder.name, cache_dir=cache)]
    except Exception as err:  # CachedRepoTreeNotFoundError: nothing cached
        if type(err).__name__ != "CachedRepoTreeNotFoundError":
            raise
        return None


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What the client raises when the hub cannot be reached: its offline error and the transport's connection
    and timeout errors (httpx2 from huggingface_hub 2, httpx from 1, requests before)."""
    import importlib

    from huggingface_hub.errors import OfflineModeIsEnabled

    found: list[type[BaseException]] = [OfflineModeIsEnabled]
    transports = {"httpx2": ("ConnectError", "TimeoutException"), "httpx": ("ConnectError", "TimeoutException")}
    transports["requests"] = ("ConnectionError", "Timeout")
    for module, names in transports.items():
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(loaded, name) for name in names if hasattr(loaded, name)]
    return tuple(found)


def _first_sentence(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _silent_tqdm() -> type:
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
