"""The re-audit's hostile inputs (issue 48, item 6): each ends in one line before any work, or is bounded."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmerge.errors import RecipeError, SpecmergeError
from specmerge.methods import get_method
from specmerge.pipeline.recipe.layered import MAX_LAYER_VALUES, validate_layered
from specmerge.pipeline.recipe.model import Recipe, load_recipe
from specmerge.pipeline.run.memory import merge_state_dicts
from specmerge.tuning.evaluation import EvaluationError, command_evaluator
from specmerge.tuning.space import MAX_SETTINGS, parse_space
from specmerge.tuning.tune import tune
from test_safety_inputs import cli_error
from tiny_models import build_family, llama_config


def nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 30_000), key=st.sampled_from(["params", "overrides", "experts", "modules", "base"]))
def test_a_recipe_nested_to_any_depth_is_read_or_refused_in_one_line(depth, key):
    """The recipe fuzzing's missing dimension: nesting depth, in a Python mapping and in a YAML file."""
    try:
        Recipe.from_dict({"base": "b", "experts": ["a"], key: nested(depth)})
    except RecipeError as err:
        assert "\n" not in str(err)


def test_a_yaml_recipe_nested_thousands_deep_is_refused_in_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("base: b\nexperts: [a]\nparams: {scale: " + "[" * 30_000 + "]" * 30_000 + "}\n")
    with pytest.raises(RecipeError, match="nested too deeply") as err:
        load_recipe(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("printed", "expected"),
    [("9" * 400, "must be a finite number"), ("[" * 50_000 + "]" * 50_000, "not a number or a JSON object")],
)
def test_an_evaluation_printing_a_huge_integer_or_deep_json_stops_in_one_line(tmp_path, printed, expected):
    (tmp_path / "out.txt").write_text(printed + "\n")
    evaluate = command_evaluator(f"cat {tmp_path / 'out.txt'} # {{model}}")
    with pytest.raises(EvaluationError, match=expected) as err:
        evaluate(tmp_path, 1.0)
    assert "\n" not in str(err.value)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has already stopped


def test_the_evaluation_timeout_stops_the_commands_children_too(tmp_path):
    """--timeout used to kill only the shell; the evaluation's own children kept running."""
    pids = tmp_path / "pids"
    evaluate = command_evaluator(f"sh -c 'sleep 60 & echo $! > {pids}; wait' # {{model}}", timeout=1.0)
    with pytest.raises(EvaluationError, match=r"ran longer than 1\.0 s"):
        evaluate(tmp_path, 1.0)
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_search_space_too_large_is_refused_with_its_count_before_any_work():
    method = get_method("swudi")
    space = {"rank_ratio": {"range": [0.1, 0.9], "num": 1000}, "t": {"range": [10, 1000], "num": 1000}}
    with pytest.raises(
        RecipeError, match=rf"5,000,000 settings \(1000 rank_ratio x 1000 t x 5 scale\); at most {MAX_SETTINGS:,}"
    ):
        parse_space(method, space, {})
    with pytest.raises(RecipeError, match="num must be a whole number from 1 to 1000"):
        parse_space(method, {"t": {"range": [1, 2], "num": 10**9}}, {})
    with pytest.raises(ValueError, match=f"1000000 values across layers; at most {MAX_LAYER_VALUES}"):
        validate_layered(get_method("task_arithmetic"), {"scale": [0.5] * 1_000_000})


def test_a_tune_cache_inside_an_input_is_refused(tmp_path):
    base, experts = build_family(tmp_path / "models", "llama", n_experts=2)
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "swudi"}
    with pytest.raises(SpecmergeError, match="overlaps the input"):
        tune(recipe, tmp_path / "tune", evaluate=lambda model: 1.0, cache=base / "cache", progress=False)
    assert not (base / "cache").exists()


def test_the_same_state_dict_twice_is_refused_as_the_same_files_are():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config()).state_dict()
    expert = {k: v + 0.01 for k, v in base.items()}
    for experts in ([expert, expert], [expert, dict(expert)], [base, expert]):
        with pytest.raises(RecipeError, match="again \\(the same tensors in memory\\)"):
            merge_state_dicts(base, experts, method="task_arithmetic")


def test_an_unreachable_ray_address_is_refused_before_any_work(tmp_path, capsys):
    """It used to hang for as long as Ray retried, with the output's work folder already made."""
    pytest.importorskip("ray")
    base, experts = build_family(tmp_path / "models", "llama", n_experts=2)
    out = tmp_path / "out"
    args = [
        "merge",
        str(base),
        *map(str, experts),
        "-o",
        str(out),
        "-q",
        "--executor",
        "ray",
        "--address",
        "127.0.0.1:9",
    ]
    capsys.readouterr()
    started = time.monotonic()
    err = cli_error(args, capsys)
    assert "could not reach the Ray cluster at 127.0.0.1:9 within 10 s" in err
    assert time.monotonic() - started < 60 and not out.exists() and not list(tmp_path.glob(".*"))


def test_a_tokenizer_that_needs_remote_code_is_refused_naming_its_own_folder(tmp_path):
    """The message used to point at the temporary copy transformers read, already deleted."""
    import json
    import shutil

    from specmerge.io.formats.protocol import SourceError
    from specmerge.io.output.tokenizers import read_tokenizer
    from token_models import build

    _, experts = build(tmp_path / "tok")
    folder = tmp_path / "custom"
    shutil.copytree(experts[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as err:
        read_tokenizer(folder, "expert 'custom'")
    assert "specmerge-tokenizer-" not in str(err.value) and str(folder) in str(err.value), str(err.value)


def test_expert_rows_beyond_its_tokenizer_and_the_output_are_said_when_dropped(tmp_path, capsys):
    """An expert with 300 embedding rows and a tokenizer of 66 tokens: the 234 rows no token names used to be
    dropped from the 66-row output without a word."""
    from safetensors.torch import load_file, save_file

    from specmerge.cli import main
    from token_models import build

    base, experts = build(tmp_path / "tok")
    tool = experts[0]
    state = load_file(tool / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = 0.02 * torch.randn(300 - state[name].shape[0], state[name].shape[1], generator=g)
        state[name] = torch.cat([state[name], extra]).contiguous()
    save_file(state, tool / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["merge", str(base), str(tool), "-o", str(tmp_path / "out"), "-m", "task_arithmetic"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"expert 'tool' has 300 rows in '[\w.]+' but its tokenizer names 66 tokens", err), err
    assert "the 234 rows beyond both" in err and "which has 66" in err


def test_ray_under_quiet_prints_nothing_and_leaves_no_session_files(tmp_path):
    """Ray printed its token-authentication warning under -q and left its session logs in /tmp (a real process:
    Ray's own log handlers write to the process's stderr)."""
    pytest.importorskip("ray")
    import subprocess
    import sys
    import tempfile

    base, experts = build_family(tmp_path / "models", "llama", n_experts=2)
    before = {p.name for p in Path(tempfile.gettempdir()).glob("specmerge-ray-*")}
    args = ["merge", str(base), *map(str, experts), "-o", str(tmp_path / "out"), "-q", "-m", "task_arithmetic"]
    done = subprocess.run(
        [sys.executable, "-m", "specmerge", *args, "--executor", "ray"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert {p.name for p in Path(tempfile.gettempdir()).glob("specmerge-ray-*")} == before
