"""Inputs given as Hugging Face hub ids (``org/name@revision``) instead of local paths.

- :mod:`.ids`: which specs are hub ids, and which local files each input reads (``resolve_input``);
- :mod:`.snapshot`: a hub repository fetched into the local cache, only the files a merge reads
  (``fetch_snapshot``).
"""
