"""The command line is generated from the Recipe and InspectOptions models (issue 14).

Every field of both models is reachable from the command line (the few Recipe fields left out are listed
here with the reason), ``--help`` shows each field's description, a flag typed on the command line reaches
the model unchanged, the flags of earlier versions still parse, and the one ``key=value`` parser reads values
as a YAML recipe does. The command line's refusals (one line, exit 2) are tested in test_validation.py.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmerge.cli import build_parser, main
from specmerge.cli.commands import NOT_ON_COMMAND_LINE, PATHS
from specmerge.diagnostics.options import InspectOptions
from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.model import Override, Recipe
from specmerge.pipeline.recipe.values import option_flag, parse_pairs, parse_value
from specmerge.pipeline.run import api

# Recipe fields `specmerge merge` deliberately does not offer, and why.
NOT_EXPOSED: dict[str, str] = {"layers": "a frankenmerge (no experts) is a recipe"}  # all others have a flag

# A value for every exposed field, as typed, and what the model must hold afterwards.
MERGE_SAMPLES = {
    "expert_keys": (["--expert-key", "first", "--expert-key", "second"], ["first", "second"]),
    "expert_weights": (["--weight", "0.7", "--weight", "0.3"], [0.7, 0.3]),
    "expert_params": (["--expert-params", "{density: 0.5}", "--expert-params", "{}"], [{"density": 0.5}, {}]),
    "method": (["-m", "ties"], "ties"),
    "params": (["-p", "density=0.25", "--param", "scale=.5"], {"density": 0.25, "scale": 0.5}),
    "non_matrix": (["--non-matrix", "keep_base"], "keep_base"),
    "scale_non_matrix": (["--scale-non-matrix"], True),
    "merge_embeddings": (["--merge-embeddings"], True),
    "chat_template": (["--chat-template", "base"], "base"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "compute_dtype": (["--compute-dtype", "float64"], "float64"),
    "device": (["--device", "cuda:1"], "cuda:1"),
    "gpu_memory": (["--gpu-memory", "20GiB"], "20GiB"),
    "shard_size": (["--shard-size", "500MB"], "500MB"),
    "output_format": (["--output-format", "lora"], "lora"),
    "max_rank": (["--max-rank", "8"], 8),
    "quantize": (["--quantize", "fp8-block"], "fp8-block"),
    "config_source": (["--config-source", "e2"], "e2"),
    "tokenizer_source": (["--tokenizer-source", "e2"], "e2"),
    "executor": (["--executor", "ray"], "ray"),
    "address": (["--executor", "ray", "--address", "ray://head:10001"], "ray://head:10001"),
    "overrides": (
        ["--override", "*.mlp.*=keep_base", "--override", "*norm*=average"],
        [Override(pattern="*.mlp.*", action="keep_base"), Override(pattern="*norm*", action="average")],
    ),
    "modules": (
        ["--module", "vision_tower.*=e1", "--module", "classifier.*=drop"],
        {"vision_tower.*": "e1", "classifier.*": "drop"},
    ),
}
INSPECT_SAMPLES = {
    "layers": (["--layers", r"layers\.[0-3]\.mlp"], r"layers\.[0-3]\.mlp"),
    "methods": (["-m", "swudi", "--method", "ties:density=0.5"], ("swudi", "ties:density=0.5")),
    "rank_ratio": (["--rank-ratio", "0.5"], 0.5),
    "t": (["--t", ".inf"], math.inf),
    "tikhonov_alpha": (["--tikhonov-alpha", "1e-2"], 0.01),
    "tau_init": (["--tau-init", "zero"], "zero"),
    "wudi": (["--no-wudi"], False),
    "wudi_layer": (["--wudi-layer", "model.layers.1.mlp.up_proj.weight"], "model.layers.1.mlp.up_proj.weight"),
    "wudi_steps": (["--wudi-steps", "7"], 7),
    "wudi_init": (["--wudi-init", "mean"], "mean"),
    "adam_lr": (["--adam-lr", "0.001"], 0.001),
    "gd_lr": (["--gd-lr", "0.5"], 0.5),
    "representatives": (["--representatives", "2"], 2),
    "compute_dtype": (["--compute-dtype", "float64"], "float64"),
    "device": (["--device", "auto"], "auto"),
    "plots": (["--no-plots"], False),
}


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return "".join(capsys.readouterr().out.split())  # argparse wraps lines: compare without whitespace


def test_every_field_has_a_description():
    for model in (Recipe, InspectOptions):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_merge_offers_every_recipe_field_with_its_description(capsys):
    assert set(NOT_ON_COMMAND_LINE) == set(NOT_EXPOSED)
    text = _help(capsys, "merge")
    exposed = [name for name in Recipe.model_fields if name not in NOT_EXPOSED]
    assert set(exposed) == set(MERGE_SAMPLES) | set(PATHS)
    for name in exposed:
        description = "".join(Recipe.model_fields[name].description.split())
        assert description in text, name
        assert name in PATHS or option_flag(Recipe, name) in text, name


def test_inspect_offers_every_option_with_its_description(capsys):
    text = _help(capsys, "inspect")
    assert set(InspectOptions.model_fields) == set(INSPECT_SAMPLES)
    for name, field in InspectOptions.model_fields.items():
        assert "".join(field.description.split()) in text, name
        assert option_flag(InspectOptions, name) in text, name


def test_merge_flags_reach_the_recipe(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(api, "run_recipe", lambda recipe, output, **kw: seen.append(recipe) or _report(recipe))
    base, experts = str(tmp_path / "base"), [str(tmp_path / "e1"), str(tmp_path / "e2")]
    for name, (typed, expected) in MERGE_SAMPLES.items():
        seen.clear()
        extra = ["--output-format", "lora"] if name == "max_rank" else []
        argv = ["merge", base, *experts, "-o", str(tmp_path / "out"), "-m", "ties", *extra, *typed]
        assert main(argv) == 0, (name, capsys.readouterr().err)
        held = getattr(seen[0], name)
        if name == "params":
            held = {key: held[key] for key in expected}
        assert held == expected, name
    seen.clear()
    assert main(["merge", base, *experts, "-o", str(tmp_path / "out")]) == 0
    assert seen[0] == Recipe(base=base, experts=experts)  # nothing typed: the recipe's defaults


def test_inspect_flags_reach_the_options(tmp_path, monkeypatch, capsys):
    import specmerge.diagnostics.run as inspect_module

    seen = []

    def fake_inspect(base, experts, output, **kwargs):
        seen.append((base, experts, kwargs))
        return {"layers_inspected": 0, "seconds": 0.0}

    monkeypatch.setattr(inspect_module, "inspect_model", fake_inspect)
    for name, (typed, expected) in INSPECT_SAMPLES.items():
        seen.clear()
        assert main(["inspect", "b", "e1", "e2", "-o", str(tmp_path / "out"), *typed]) == 0, name
        base, experts, kwargs = seen[0]
        assert (base, experts) == ("b", ["e1", "e2"])
        options = {key: value for key, value in kwargs.items() if key in InspectOptions.model_fields}
        assert options == {name: options[name]}, name  # only what was typed
        assert getattr(InspectOptions(**options), name) == expected, name
    capsys.readouterr()


def _report(recipe: Recipe) -> dict:
    return {"tensors": [], "method": recipe.method, "seconds": 0.0}


@pytest.mark.parametrize(
    "argv",
    [
        ["merge", "b", "e", "-o", "o", "-m", "ties", "-p", "density=0.5", "--param", "scale=1", "--dtype", "float16"],
        ["merge", "b", "e", "-o", "o", "--device", "cpu", "--shard-size", "2GB", "--output-format", "lora"],
        ["merge", "b", "e", "--output", "o", "--max-rank", "4", "--overwrite", "-q", "--quiet", "--no-fsync"],
        ["merge", "b", "e", "-o", "o", "--threads", "2"],
        ["run", "r.yaml", "-o", "o", "--overwrite", "-q", "--no-fsync", "--threads", "1"],
        ["inspect", "b", "e", "-o", "o", "--out", "o", "--output", "o", "--overwrite", "-q", "--layers", "x"],
        ["inspect", "b", "e", "-o", "o", "-m", "swudi", "--method", "ties:density=0.5", "--rank-ratio", "0.5"],
        ["inspect", "b", "e", "-o", "o", "--t", "10", "--wudi-layer", "w", "--wudi-steps", "3", "--adam-lr", "1e-4"],
        ["inspect", "b", "e", "-o", "o", "--gd-lr", "0.1", "--no-wudi", "--no-plots", "--compute-dtype", "float64"],
        ["inspect", "b", "e", "-o", "o", "--device", "cpu", "--threads", "2"],
        ["methods"],
        ["methods", "swudi"],
        ["demo", "--seed", "1", "--workdir", "w"],
    ],
)
def test_the_flags_of_earlier_versions_still_parse(argv):
    build_parser().parse_args(argv)


def test_python_dash_m_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "specmerge", "merge", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--shard-size" in done.stdout


def test_key_value_pairs_are_read_as_in_a_recipe():
    pairs = ["scale=0.5", "rule=psqrt", "flag=true", "t=.inf", "empty=", "size=5GB", " scale = 2 "]
    assert parse_pairs(pairs, "--param") == {
        "scale": 2,  # a later key replaces an earlier one; blanks around the key are dropped
        "rule": "psqrt",
        "flag": True,
        "t": math.inf,
        "empty": "",
        "size": "5GB",
    }
    assert parse_value("[1, 2]", "--x") == [1, 2] and parse_value("  ", "--x") == "  "
    for pair, message in [
        ("scale", "--param expects key=value, got 'scale'"),
        ("=1", "--param expects key=value, got '=1'"),
        ("scale=[1", "--param scale= '[1': not a valid value"),
    ]:
        with pytest.raises(RecipeError, match=message.replace("[", r"\[")):
            parse_pairs([pair], "--param")


def test_method_specs_use_the_same_parser():
    from specmerge.diagnostics.method_specs import parse_method_spec

    spec = parse_method_spec("swudi: t=.inf, rank_ratio=.5")
    assert (spec.name, spec.params) == ("swudi", {"t": math.inf, "rank_ratio": 0.5})
    with pytest.raises(RecipeError, match="method 'swudi:t': expects key=value, got 't'"):
        parse_method_spec("swudi:t")


def test_methods_lists_the_declared_capabilities(capsys):
    from specmerge.methods import all_methods

    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    blocks = {block.split()[0]: block for block in listing.split("\n\n")}
    assert set(blocks) == set(all_methods())
    for name, method in all_methods().items():
        text = " ".join(blocks[name].split())
        assert ("linear in the deltas" in text) == method.linear, name
        assert ("exact on LoRA cores" in text) == method.factored, name
        assert ("seeded" in text) == method.seeded, name
        assert ("any tensor shape" in text) == (not method.needs_matrix), name
    assert "exact on LoRA cores" in blocks["swudi_a"] and "seeded" in blocks["dare_ties"]


def test_specmerge_bench_is_specmerge_bench():
    """``specmerge bench ...`` runs ``specmerge-bench ...`` (the issue's spelling): its help, its errors, its status."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "specmerge", "bench", *a], capture_output=True, text=True)  # noqa: E731
    helped = run("accuracy", "--help")
    assert helped.returncode == 0 and "--precision {auto,bfloat16,float32}" in helped.stdout, helped.stderr
    assert run("--help").stdout.startswith("usage: specmerge-bench")
    bad = run("accuracy", "--cache", "x", "--precision", "float16")
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert bad.stderr.strip().splitlines()[-1].startswith("specmerge-bench accuracy: error: argument --precision")
    assert "bench" in build_parser().format_help()


def test_specmerge_bench_in_process_returns_the_benchmarks_status(capfd):
    """Called as a function, ``main(["bench", ...])`` runs the benchmark as a child and returns its status; the
    caller's process goes on (the library itself never imports specmerge_bench: tests/test_architecture.py)."""
    assert main(["bench", "speed", "--no-such-flag"]) == 2
    assert "specmerge-bench: error: unrecognized arguments: --no-such-flag" in capfd.readouterr().err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }


def test_every_help_is_plain_text(capsys):
    """Descriptions and help texts come from docstrings and field descriptions: their reStructuredText literals
    (````x````) are shown as `x`, in every command's --help and specmerge-bench's."""
    import specmerge.cli
    from specmerge_bench import cli as bench_cli
    from specmerge_bench import speed

    shown = {}
    for name in ["", *_subcommands(build_parser())]:
        if name == "bench":
            continue  # specmerge-bench's own help, below
        with pytest.raises(SystemExit):
            main([name, "--help"] if name else ["--help"])
        shown[name] = capsys.readouterr().out
    for name in ["", *_subcommands(bench_cli.build_parser())]:
        with pytest.raises(SystemExit):
            bench_cli.main([name, "--help"] if name else ["--help"])
        shown[f"bench {name}"] = capsys.readouterr().out
    assert {name for name, text in shown.items() if "``" in text} == set()
    assert "``merge``" in specmerge.cli.__doc__ and "The options of `merge` and `inspect`" in shown[""]
    assert "``specmerge-bench speed``" in speed.__doc__ and "`specmerge-bench speed`" in shown["bench speed"]


def _through_a_pipe(args: list[str], *, read_first_line: bool) -> tuple[str, int, str]:
    """``python -m specmerge ARGS`` with stdout a real pipe of one page (4 KiB, so that a longer output cannot fit
    in it) whose reader goes away after reading the first line, or before anything is written; the line read,
    the exit status and stderr."""
    import fcntl

    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
    if not read_first_line:
        os.close(reader)
    child = subprocess.Popen([sys.executable, "-m", "specmerge", *args], stdout=writer, stderr=subprocess.PIPE)
    os.close(writer)
    line = b""
    if read_first_line:
        while not line.endswith(b"\n") and (byte := os.read(reader, 1)):
            line += byte
        os.close(reader)
    _, err = child.communicate(timeout=300)
    return line.decode(), child.returncode, err.decode()


@pytest.mark.skipif(sys.platform != "linux", reason="sizes the pipe with fcntl's F_SETPIPE_SZ (Linux)")
@pytest.mark.parametrize(
    ("args", "read_first_line", "first_line"),
    [
        (["methods"], True, "weight_average  (Weight average)\n"),  # `specmerge methods | head -1`
        (["schema"], True, "{\n"),
        (["methods", "ties"], False, ""),  # all of it held in stdout's buffer until the end
        (["bench", "speed", "--sets", "tiny", "--methods", "task_arithmetic", "--repeats", "1"], False, ""),
    ],
)
def test_a_reader_gone_from_stdout_ends_the_output_quietly(args, read_first_line, first_line):
    """As `yes | head -1` ends: no message, status 141 (128 + SIGPIPE), never "error: [Errno 32] Broken pipe"."""
    assert _through_a_pipe(args, read_first_line=read_first_line) == (first_line, 141, "")


def test_a_broken_pipe_other_than_stdout_is_still_an_error(capsys):
    from specmerge.cli.running import broken_pipe

    assert broken_pipe(BrokenPipeError(32, "Broken pipe"), "specmerge") == 2  # stdout here is no pipe
    assert capsys.readouterr().err == "specmerge: error: [Errno 32] Broken pipe\n"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _gone(pid: int, *, group: bool = False) -> bool:
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="finds the benchmark's process in /proc")
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_stopping_specmerge_bench_stops_the_benchmark(signum, status):
    """``specmerge bench`` runs the benchmark as a child: a signal to it (kill, a job scheduler's SIGTERM, Ctrl-C)
    reaches the benchmark and what it started (its process group), and never leaves it running as an orphan."""
    timed = ["speed", "--sets", "tiny", "--methods", "task_arithmetic", "--repeats", "1000000000", "--threads", "1"]
    parent = subprocess.Popen(
        [sys.executable, "-m", "specmerge", "bench", *timed],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    benchmark = []
    try:
        assert parent.stdout.readline().startswith("# torch")  # the benchmark's first line: it is running
        benchmark = _children(parent.pid)
        assert len(benchmark) == 1
        parent.send_signal(signum)
        assert parent.wait(timeout=120) == status  # the benchmark's status: 143 killed by SIGTERM, 130 interrupted
        deadline = time.monotonic() + 30  # a generous bound on a loaded machine; it is gone at once
        while not (_gone(benchmark[0]) and _gone(benchmark[0], group=True)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(benchmark[0]) and _gone(benchmark[0], group=True)
    finally:
        for pid in [*benchmark, parent.pid]:  # without the fix, the orphan: stop it here
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        parent.communicate()
