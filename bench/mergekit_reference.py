"""Reference outputs of mergekit itself for the mergekit corpus (issue 51), made once and committed.

Every config of ``tests/mergekit_corpus`` is run by ``mergekit-yaml`` on the corpus's tiny models
(``tests/mergekit_inputs.py``: built here, rebuilt bit for bit by the tests), and its merged tensors are written to
``tests/data/mergekit/<config>.safetensors``. ``tests/data/mergekit/references.json`` records, per config, the
config's sha256, mergekit's version, the inputs' digest, the command and its seconds, or mergekit's own error when it
refuses the config. The tests compare specmerge's output for the same config with these tensors; they need no
mergekit.

mergekit has its own dependencies, so it lives in a virtualenv of its own (its torch pinned as ours)::

    python3.11 -m venv /work/mergekit-venv
    /work/mergekit-venv/bin/pip install -c constraints.txt mergekit          # 0.1.5 when this was written
    .venv/bin/python bench/mergekit_reference.py --mergekit /work/mergekit-venv/bin/mergekit-yaml [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mergekit_inputs import (
    LORA_NAMES,
    REFERENCES,
    build_inputs,
    config_digest,
    configs,
    family,
    inputs_digest,
    render,
    tokenizer_record,
)

SEED = 0  # --random-seed: DARE and DELLA's masks


def mergekit_version(mergekit_yaml: Path) -> str:
    python = mergekit_yaml.parent / "python"
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def run_one(mergekit_yaml: Path, config: Path, folders: dict[str, Path], work: Path) -> dict:
    """Run mergekit on ``config``; write its tensors beside the references and return the record."""
    rendered, out = work / f"{config.stem}.yaml", work / config.stem
    rendered.write_text(render(config, folders))
    command = [str(mergekit_yaml), str(rendered), str(out), "--random-seed", str(SEED), "--no-cuda"]
    lora = set(LORA_NAMES) & set(family(config))
    if lora:  # mergekit applies a model+lora's adapter in a folder of its own
        command += ["--lora-merge-cache", str(work / "lora-cache")]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    record = {
        "config_sha256": config_digest(config),
        "command": f"mergekit-yaml {config.name} OUT --random-seed {SEED} --no-cuda"
        + (" --lora-merge-cache DIR" if lora else ""),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {**record, "refused": lines[-1] if lines else f"exit {done.returncode}"}
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file({k: v.contiguous() for k, v in tensors.items()}, REFERENCES / f"{config.stem}.safetensors")
    config_out = json.loads((out / "config.json").read_text())
    record = {**record, "tensors": len(tensors), "num_hidden_layers": config_out.get("num_hidden_layers")}
    return {**record, **tokenizer_record(out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit", type=Path, required=True, help="the mergekit-yaml of mergekit's own virtualenv")
    parser.add_argument("--only", nargs="+", help="config names (file stems) to run again; default: all")
    args = parser.parse_args()
    REFERENCES.mkdir(parents=True, exist_ok=True)
    index = REFERENCES / "references.json"
    records = json.loads(index.read_text()) if index.is_file() else {}
    version = mergekit_version(args.mergekit)
    with tempfile.TemporaryDirectory() as tmp:
        folders = build_inputs(Path(tmp) / "inputs")
        for config in configs():
            if args.only and config.stem not in args.only:
                continue
            record = run_one(args.mergekit, config, folders, Path(tmp))
            digest = inputs_digest(folders, family(config))
            records[config.stem] = {"mergekit": version, "inputs_sha256": digest, **record}
            print(f"{config.stem}: {record.get('refused') or str(record['tensors']) + ' tensors'} "
                  f"({record['seconds']} s)")  # fmt: skip
    index.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
