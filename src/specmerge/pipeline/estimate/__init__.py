"""What a merge will cost, before it runs: bytes, peak memory and seconds per work item.

- :mod:`.cost`: the cost model: per work item, what it reads and writes, its operations, memory and seconds;
- :mod:`.calibrate`: this machine's rates, measured by small timed probes;
- :mod:`.dryrun`: the dry run (``specmerge merge ... --dry-run``): the whole plan with its costs, nothing written.
"""
