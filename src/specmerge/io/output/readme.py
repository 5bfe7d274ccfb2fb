"""A model folder's README.md (its model card): the license its YAML front matter states.

:func:`read_license` gives the license keys of a model folder, for the card of a merge of it. The README is read
as every other file of a model folder (:func:`specmerge.io.formats.files.folder_file`: a README.md that is a link out of
the folder, or out of its Hugging Face cache repository's ``blobs/``, stops the merge with one line); only its
first 64 KiB are read, parsed with ``yaml.safe_load``; a front matter that does not parse, or a value that is not
a plain license id, counts as no license.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from specmerge.io.formats.files import folder_file
from specmerge.io.formats.layout import LayoutError, read_config

README = "README.md"
README_BYTES = 1 << 16  # the front matter is read from the first 64 KiB
LICENSE_ID = re.compile(r"[\w.+-]{1,64}")  # a hub license id (apache-2.0, llama3.2, other, ...) or license_name
LINK = re.compile(r"https?://[^\s\"'<>]{1,300}")


def read_license(base: str | os.PathLike) -> dict[str, str]:
    """The license keys of the model at ``base`` (a folder; a single weights file has none): ``license`` (and,
    for ``other``, ``license_name`` and an http(s) ``license_link``) from the YAML front matter of its README.md,
    else ``license`` from its config.json; empty when unknown."""
    folder = Path(base).expanduser()
    if not folder.is_dir():
        return {}
    found = _front_matter_license(folder)
    if found:
        return found
    try:
        config = read_config(folder)
    except LayoutError:
        return {}
    value = config.get("license") if isinstance(config, dict) else None
    return {"license": value} if isinstance(value, str) and LICENSE_ID.fullmatch(value) else {}


def front_matter(folder: Path) -> dict | None:
    """The YAML front matter (between the leading ``---`` lines) of ``folder``'s README.md as a mapping, or None
    when there is no README, no front matter, or it does not parse to a mapping. Raises SourceError for a README
    that is not a readable file of the folder."""
    readme = folder / README
    if not os.path.lexists(readme):
        return None
    real = folder_file(readme, folder)
    with open(real, "rb") as file:
        text = file.read(README_BYTES).decode("utf-8", errors="replace")
    match = re.match(r"---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.DOTALL)
    if match is None:
        return None
    try:
        meta = yaml.safe_load(match.group(1))
    except (yaml.YAMLError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def _front_matter_license(folder: Path) -> dict[str, str]:
    meta = front_matter(folder) or {}
    value = meta.get("license")
    if not isinstance(value, str) or not LICENSE_ID.fullmatch(value):
        return {}
    found = {"license": value}
    if value == "other":
        name, link = meta.get("license_name"), meta.get("license_link")
        if isinstance(name, str) and LICENSE_ID.fullmatch(name):
            found["license_name"] = name
        if isinstance(link, str) and LINK.fullmatch(link):
            found["license_link"] = link
    return found
