"""The accuracy benchmark's merge stage equals merging from files with `specmerge merge`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specmerge import all_methods, get_method
from specmerge.pipeline.run.api import merge
from specmerge_bench.accuracy.merging import Candidate, merge_candidates, wudi_snapshots
from tiny_models import build_family

KEYS = ["e0", "e1", "e2"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    base, experts = build_family(tmp_path_factory.mktemp("bert"), "bert", n_experts=3, seed=4)
    return base, experts, load_file(base / "model.safetensors"), [load_file(e / "model.safetensors") for e in experts]


CANDIDATES = [
    Candidate("swudi", "swudi", {"rank_ratio": 0.5, "t": 300.0}),
    Candidate("swudi", "swudi", {"rank_ratio": 0.8, "t": 1300.0}),
    Candidate("swudi_a", "swudi_a", {"rule": "psqrt"}),
    Candidate("closed_form", "closed_form", {}),
    Candidate("ties", "ties", {}),
    Candidate("dare_ties", "dare_ties", {}),
    Candidate("task_arithmetic", "task_arithmetic", {}),
]


def test_candidates_equal_merges_from_files(bert, tmp_path):
    base_dir, expert_dirs, base, experts = bert
    deltas = merge_candidates(base, experts, CANDIDATES, progress=False)
    for candidate, scale in zip(CANDIDATES, (0.3, 1.0, 0.5, 0.2, 1.0, 0.7, 0.3), strict=True):
        out = tmp_path / candidate.key
        params = {**candidate.params, "scale": scale}
        merge(base_dir, expert_dirs, out, method=candidate.method, params=params, expert_keys=KEYS, progress=False,
              merge_embeddings=False)  # fmt: skip
        expected = load_file(out / "model.safetensors")
        state = deltas.state(base, candidate, scale)
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{candidate.key} {name}")


def test_wudi_snapshots_equal_separate_runs():
    tau = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    snapshots = wudi_snapshots(tau, [0, 2, 5], lr=1e-3)
    for steps in (0, 2, 5):
        torch.testing.assert_close(snapshots[steps], get_method("wudi")(tau, steps=steps, lr=1e-3).delta)


SCALED = sorted(name for name, m in all_methods().items() if any(p.name == "scale" for p in m.params))


@pytest.mark.parametrize("name", SCALED)
def test_every_method_is_linear_in_its_scale(name):
    """What lets one delta per candidate serve the whole scale grid."""
    tau = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    method = get_method(name)
    fast = {"steps": 3} if any(p.name == "steps" for p in method.params) else {}
    one = method(tau, tensor_name="x", expert_keys=KEYS, **fast, scale=1.0).delta
    for scale in (0.1, 0.3, 1.7):
        torch.testing.assert_close(
            method(tau, tensor_name="x", expert_keys=KEYS, **fast, scale=scale).delta, scale * one
        )


def test_selection_uses_val_only_and_scores_are_cached(bert, tmp_path, monkeypatch):
    from specmerge_bench.accuracy import bench, report, rows

    _, _, base, experts = bert
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5, 0.8), "t": (300.0,)}, "exponential": {"t": (300.0,)}})
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 3))
    tasks = dict(zip(KEYS, experts, strict=True))
    name = "encoder.layer.0.attention.self.query.weight"
    calls = []

    def score(state, split):  # val prefers states near expert e0 on this layer; test prefers the base
        calls.append(split)
        near = -float((state[name] - (experts[0] if split == "val" else base)[name]).norm())
        return {t: near + i for i, t in enumerate(KEYS)}

    cache = bench.ScoreCache(tmp_path / "scores.json")
    result = bench.evaluate_seed(base, tasks, score, cache, progress=False)
    for label, row in result["rows"].items():
        best = max(
            (sum(cache.scores[f"{c.key}|{s}|val"].values()) / 3, s)
            for r in small + rows.step_rows() if r.label == label
            for c in r.candidates for s in bench.SCALES
        )  # fmt: skip
        assert row["val_mean"] == best[0], label
    summary = report.summarize([result, result])
    assert summary["rows"]["ties"]["average"]["std"] == 0.0
    assert "| TIES (top 20 %) |" in report.markdown(summary)
    n = len(calls)
    again = bench.evaluate_seed(base, tasks, score, bench.ScoreCache(tmp_path / "scores.json"), progress=False)
    assert len(calls) == n  # every score came from the cache
    for label, row in again["rows"].items():
        assert {**row, "seconds": None} == {**result["rows"][label], "seconds": None}
    assert [p.name for p in report.plots(summary, tmp_path)] == ["accuracy.png", "wudi_steps.png"]


def test_a_merge_code_change_rescores_only_the_changed_weights(bert, tmp_path, monkeypatch):
    """Scores found by the digest of the scored weights: a new code key merges again but scores only the candidates
    whose weights changed; scores cached before digests were recorded get them on the next run."""
    from specmerge_bench.accuracy import bench, rows

    _, _, base, experts = bert
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0,)}, "exponential": {"t": (300.0,)}})
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 3))
    tasks = dict(zip(KEYS, experts, strict=True))
    name = "encoder.layer.0.attention.self.query.weight"
    scored, merged = [], []

    def score(state, split):
        scored.append(split)
        return {t: -float((state[name] - experts[i][name]).norm()) for i, t in enumerate(KEYS)}

    def merger(nudge: str | None):
        def merge(candidates, steps, show):
            merged.append(len(candidates) + len(steps))
            deltas = merge_candidates(base, experts, candidates, wudi_steps=steps, progress=False)
            for key, delta in deltas.method.items():
                if nudge is not None and key.startswith(f"{nudge}-"):
                    delta[name] = delta[name] * (1 + 2**-20)  # a change at float32 rounding, as a new route makes
            return deltas

        return merge

    def run(code: str, *, weights: bool = True, nudge: str | None = None):
        scored.clear(), merged.clear()
        cache = bench.ScoreCache(tmp_path / f"{code}.json", tmp_path / "by-weights.json" if weights else None)
        return bench.evaluate_seed(base, tasks, score, cache, progress=False, merge=merger(nudge))

    legacy = run("old", weights=False)  # scores cached by setting only, as before digests were recorded
    total = len(scored)
    assert total > 0 and not (tmp_path / "by-weights.json").exists()
    again = run("old")  # same code key: merged once more to record the digests, nothing scored
    assert merged[0] > 0 and scored == []
    for label, row in again["rows"].items():
        assert {**row, "seconds": None} == {**legacy["rows"][label], "seconds": None}
    run("old")
    assert merged == [] and scored == []  # everything cached with digests: no merge at all
    run("new")  # a new code key whose weights are bit for bit the old ones: merged, nothing scored
    assert merged[0] > 0 and scored == []
    changed = run("newer", nudge="ties")
    ties = next(r for r in small if r.label == "ties")
    assert len(scored) == len(ties.candidates) * len(bench.SCALES) + 1  # its val grid and its chosen test
    assert 0 < len(scored) < total
    assert changed["rows"]["task_arithmetic"]["test"] == legacy["rows"]["task_arithmetic"]["test"]


def test_weights_digest_sees_every_bit_name_and_dtype():
    from specmerge_bench.accuracy.scores import weights_digest

    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    state = {"a": x, "b": torch.arange(3)}
    same = weights_digest({"b": torch.arange(3), "a": x.clone()})
    assert weights_digest(state) == same
    bit = x.clone()
    bit.view(torch.int32)[2, 3] ^= 1
    for other in ({"a": bit, "b": state["b"]}, {"a": x.double(), "b": state["b"]}, {"c": x, "b": state["b"]},
                  {"a": x.reshape(5, 4), "b": state["b"]}, {"a": x.t(), "b": state["b"]}):  # fmt: skip
        assert weights_digest(other) != same
    assert weights_digest({"a": x.to(torch.bfloat16)}) != weights_digest({"a": x.to(torch.float16)})


def test_the_main_rows_are_scored_before_the_step_sweep_is_merged(bert, tmp_path, monkeypatch):
    """The WUDI sweep's long run is merged last, after every main row is scored, and the rows the paper's claims
    compare are scored first: a run stopped early keeps what matters most."""
    from specmerge_bench.accuracy import bench, rows

    _, _, base, experts = bert
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0,)}, "exponential": {"t": (300.0,)}})
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 3))
    tasks = dict(zip(KEYS, experts, strict=True))
    cache = bench.ScoreCache(tmp_path / "scores.json")
    calls = []

    def merge(candidates, steps, show):
        main_scored = all(cache.has(f"{c.key}|{s}|val") for r in small for c in r.candidates for s in bench.SCALES)
        calls.append(({c.method for c in candidates}, list(steps), main_scored))
        return merge_candidates(base, experts, candidates, wudi_steps=steps, progress=False)

    result = bench.evaluate_seed(base, tasks, lambda state, split: dict.fromkeys(KEYS, 0.5), cache, progress=False,
                                 merge=merge)  # fmt: skip
    (main_methods, main_steps, before), (sweep_methods, sweep_steps, after) = calls
    assert main_methods == {r.candidates[0].method for r in small} - {"wudi"} and main_steps == [300]
    assert not before and sweep_methods == set() and sweep_steps == [2, 3] and after
    assert list(result["rows"]) == list(dict.fromkeys(r.label for r in small + rows.step_rows()))  # registry order
    scored = [key.split("-")[0] for key in cache.scores if key.endswith("|val") and not key.startswith("base")]
    assert scored.index("tsv_m") < scored.index("weight_average")  # the claims' rows are scored first
