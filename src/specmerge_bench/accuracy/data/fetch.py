"""Fetching the accuracy data's sources: apt indexes and packages into ``<cache>/sources``, recorded with hashes.

``apt-get update`` into a private lists directory, then ``apt-get download`` of ``APT_PACKAGES``, unpacked
with ``dpkg-deb -x``; nothing is installed and root is not needed. The record (``sources/sources.json``)
holds every version and SHA-256; a later call checks the files against it and fetches nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

APT_PACKAGES = (
    "wordnet-base",
    "wamerican",
    "wfrench",
    "wngerman",
    "witalian",
    "wspanish",
    "wportuguese",
    "wdutch",
    "wswedish",
)
WORDNET_DIR = "usr/share/wordnet"
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
WORD_LIST_DIR = "usr/share/dict"
WORD_LISTS: dict[str, tuple[str, str]] = {  # language -> (file in WORD_LIST_DIR, encoding)
    "dutch": ("dutch", "utf-8"),
    "english": ("american-english", "utf-8"),
    "french": ("french", "utf-8"),
    "german": ("ngerman", "utf-8"),
    "italian": ("italian", "utf-8"),
    "portuguese": ("portuguese", "utf-8"),
    "spanish": ("spanish", "utf-8"),
    "swedish": ("swedish", "latin-1"),
}
DESCRIPTION_LANGUAGES = ("de", "en", "es", "fr", "it", "pl", "pt")


class AccuracyDataError(RuntimeError):
    """A source cannot be fetched, read or turned into a task; the message says which and what to do."""


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _apt_options(root: Path) -> list[str]:
    """apt options that keep every file apt writes under ``root`` and work without root."""
    settings = {
        "Dir::State::Lists": root / "apt" / "lists",
        "Dir::Cache": root / "apt" / "cache",
        "Debug::NoLocking": "1",
        "Acquire::Languages": ",".join(DESCRIPTION_LANGUAGES),
        "Acquire::GzipIndexes": "false",  # store indexes uncompressed: plain text, hashes independent of apt
        "APT::Sandbox::User": "root",  # when run as root, do not drop to _apt (it cannot write our folders)
    }
    return [arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]


def _run(command: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise AccuracyDataError(f"cannot run {command[0]}: {err}") from err
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("E:")] or done.stderr.splitlines()
        last = errors[-1] if errors else f"exit status {done.returncode}"
        raise AccuracyDataError(f"`{' '.join(command[:2])}` failed: {last}")
    return done.stdout


def _release_indexes(root: Path, options: list[str]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Release metadata and the release suite's Packages / Translation-* index targets fetched by apt."""
    fields = ("IDENTIFIER", "RELEASE", "CODENAME", "ORIGIN", "LABEL", "VERSION", "LANGUAGE", "FILENAME")
    fmt = "\t".join(f"$({field})" for field in fields)
    out = _run(["apt-get", "indextargets", *options, "--format", fmt])
    targets = [dict(zip(fields, line.split("\t"), strict=True)) for line in out.splitlines() if line.strip()]
    chosen = [
        t
        for t in targets
        if "-" not in t["RELEASE"]
        and (
            t["IDENTIFIER"] == "Packages"
            or (t["IDENTIFIER"] == "Translations" and t["LANGUAGE"] in DESCRIPTION_LANGUAGES)
        )
    ]
    for target in chosen:
        if not Path(target["FILENAME"]).is_file():
            raise AccuracyDataError(f"apt-get update did not fetch {target['FILENAME']} (is the mirror reachable?)")
    found = {t["LANGUAGE"] for t in chosen if t["IDENTIFIER"] == "Translations"}
    missing = [f"Translation-{language}" for language in DESCRIPTION_LANGUAGES if language not in found]
    if not any(t["IDENTIFIER"] == "Packages" for t in chosen):
        missing.insert(0, "Packages")
    if missing:
        raise AccuracyDataError(
            f"the apt sources give no {', '.join(missing)} for a release suite; "
            "the accuracy data needs Debian main (see /etc/apt/sources.list*)"
        )
    first = chosen[0]
    release = {key: first[key.upper()] for key in ("origin", "label", "codename", "version")}
    return release, chosen


def _verify(root: Path, hashes: Mapping[str, str]) -> None:
    for rel, expected in sorted(hashes.items()):
        path = root / rel
        if not path.is_file() or sha256_file(path) != expected:
            raise AccuracyDataError(
                f"{path} is missing or differs from {root / 'sources.json'}; delete {root} to fetch the sources again"
            )


def fetch_sources(cache_dir: str | Path) -> dict:
    """Fetch (once) the Debian indexes and packages the tasks are derived from; return what was recorded.

    The record (``<cache_dir>/sources/sources.json``, returned as a dict) holds the release metadata, per
    package its version, ``.deb`` file and SHA-256, and the SHA-256 of every index and unpacked file the
    tasks read, all paths relative to ``<cache_dir>/sources``. When the record exists its files are checked
    against it and nothing is fetched.
    """
    root = Path(cache_dir).resolve() / "sources"
    record_path = root / "sources.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        _verify(root, {**record["indexes"], **record["files"]})
        _verify(root, {p["file"]: p["sha256"] for p in record["packages"].values()})
        return record
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise AccuracyDataError(
                f"{tool} not found: fetching the accuracy sources needs a Debian-based system with apt; "
                f"or copy a cache directory with sources/sources.json built on one to {Path(cache_dir)}"
            )
    for sub in ("apt", "debs", "unpacked"):
        shutil.rmtree(root / sub, ignore_errors=True)
    for sub in ("apt/lists/partial", "apt/cache/archives/partial", "debs", "unpacked"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    options = _apt_options(root)
    _run(["apt-get", "update", "-q", *options])
    release, targets = _release_indexes(root, options)
    _run(["apt-get", "download", "-q", *options, *APT_PACKAGES], cwd=root / "debs")

    packages = {}
    for deb in sorted((root / "debs").glob("*.deb")):
        name, version = _run(["dpkg-deb", "--show", "--showformat=${Package}\t${Version}", str(deb)]).split("\t")
        _run(["dpkg-deb", "-x", str(deb), str(root / "unpacked")])
        packages[name] = {"version": version, "file": str(deb.relative_to(root)), "sha256": sha256_file(deb)}
    if sorted(packages) != sorted(APT_PACKAGES):
        raise AccuracyDataError(f"apt-get download gave {sorted(packages)}, expected {sorted(APT_PACKAGES)}")

    used = [Path("unpacked", WORDNET_DIR, name) for name in WORDNET_FILES]
    used += [Path("unpacked", WORD_LIST_DIR, file) for file, _ in WORD_LISTS.values()]
    record = {
        "release": release,
        "packages": packages,
        "indexes": {
            str(Path(t["FILENAME"]).relative_to(root)): sha256_file(Path(t["FILENAME"]))
            for t in sorted(targets, key=lambda t: t["FILENAME"])
        },
        "files": {str(rel): sha256_file(root / rel) for rel in used},
    }
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return record
