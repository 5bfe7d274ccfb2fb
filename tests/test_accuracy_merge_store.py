"""The accuracy benchmark's store of merged deltas: kept merges are read back, damaged ones are merged again."""

import torch

from specmerge_bench.accuracy.merge_store import MergeStore, stored_merge
from specmerge_bench.accuracy.merging import Candidate, MergedDeltas


def counting_merger(calls):
    """A merger whose deltas depend on the candidate and the step count only, recording what it was asked."""

    def merge(candidates, steps, progress):
        calls.append(([c.key for c in candidates], list(steps)))
        keys = [c.key for c in candidates] + [Candidate("wudi_steps", "wudi", {"steps": s}).key for s in steps]
        method = {k: {"w": torch.full((2, 3), float(sum(map(ord, k))))} for k in keys}
        averaged = {k: {"b": torch.full((3,), 0.5)} for k in keys}
        seconds = {c.key: 1.0 for c in candidates} | ({"wudi_steps": 2.0} if steps else {})
        return MergedDeltas(method, averaged, seconds, {k: {"dense": 1} for k in keys})

    return merge


def test_kept_merges_are_read_back_and_a_damaged_one_is_merged_again(tmp_path, capsys):
    store = MergeStore(tmp_path / "merges")
    candidates = [Candidate("ta", "task_arithmetic"), Candidate("swudi", "swudi", {"t": 300.0})]
    calls = []
    run = stored_merge(counting_merger(calls), store)
    first = run(candidates, [100, 200], False)
    assert calls == [([c.key for c in candidates], []), ([], [100, 200])]
    assert not list(store.folder.glob("*.tmp"))

    calls.clear()
    again = run(candidates, [100, 200], False)
    assert calls == []  # everything from disk, bit for bit, with its seconds and routes
    for key, tensors in first.method.items():
        assert all(torch.equal(t, again.method[key][name]) for name, t in tensors.items())
    assert again.seconds == first.seconds and again.routes == first.routes
    expected = {key: {name: t.clone() for name, t in tensors.items()} for key, tensors in first.method.items()}

    damaged = store.path(candidates[1].key)
    damaged.write_bytes(damaged.read_bytes()[:-5])  # truncated: the header no longer covers the data
    sweep = store.path(Candidate("wudi_steps", "wudi", {"steps": 200}).key)
    sweep.write_bytes(b"not safetensors")
    calls.clear()
    healed = run(candidates, [100, 200], False)
    assert calls == [([candidates[1].key], []), ([], [200])]  # only the damaged two are merged again
    err = capsys.readouterr().err
    assert str(damaged) in err and str(sweep) in err and err.count("\n") == 2
    for key, tensors in expected.items():  # (copies: what was read may map the files just damaged in place)
        assert all(torch.equal(t, healed.method[key][name]) for name, t in tensors.items())
    capsys.readouterr()
    run(candidates, [100, 200], False)  # the replaced files read back silently
    assert capsys.readouterr().err == ""
