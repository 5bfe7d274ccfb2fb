"""The demo: build a tiny Llama and four "fine-tuned" experts on disk, merge them with several methods, score.

Everything runs on the CPU in well under a minute and needs only the ``transformers`` extra. Expert
i was "fine-tuned" on its own input subspace S_i of every linear layer: its update to a weight W is
G_i S_i^T (rank d_in / 8) plus 5 % noise, the picture behind the WUDI proxy (paper Sec. 3.1). Two
scores, each 0 for the expert itself and 1 for the base model, averaged over the four experts:

- interference on the expert's own inputs, the quantity WUDI and SWUDI minimise, read from the
  merged files: sum over linear layers of ||(W_merged - W_i) S_i||^2 / ||(W_0 - W_i) S_i||^2;
- logit error on random token sequences, which also probes directions no expert was trained on:
  ||logits(merged) - logits(expert_i)||^2 / ||logits(base) - logits(expert_i)||^2. There the
  spectral methods keep their start tau_init = sum of the task vectors (like task arithmetic with
  lambda = 1), which is why the paper tunes the final scale s.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from specmerge.methods import all_methods


def demo_methods() -> list[str]:
    """The methods the demo merges with: every featured method of the registry, in registry order."""
    return [name for name, method in all_methods().items() if method.featured]


def tiny_llama_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def build_experts(root: Path, n_experts: int = 4, seed: int = 0) -> tuple[Path, list[Path], list[dict]]:
    """Save a random tiny Llama to ``root/base`` and ``n_experts`` subspace-fine-tuned copies to ``root/expert<i>``.

    Also returns, per expert, the orthonormal basis of S_i of every linear weight it was tuned on.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    model.save_pretrained(root / "base")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    experts, subspaces = [], []
    for i in range(n_experts):
        g = torch.Generator().manual_seed(seed * 1000 + i + 1)
        state, bases = {}, {}
        for name, weight in base.items():
            size = 0.3 * float(weight.std()) if weight.numel() > 1 and float(weight.std()) > 0 else 0.02
            noise = 0.05 * size * torch.randn(weight.shape, generator=g)
            if weight.dim() == 2 and "embed" not in name:
                d_out, d_in = weight.shape
                basis = bases[name] = torch.linalg.qr(torch.randn(d_in, d_in // 8, generator=g)).Q
                update = torch.randn(d_out, d_in // 8, generator=g) @ basis.T
                noise += size * update / update.std()
            state[name] = weight + noise
        model.load_state_dict(state)
        experts.append(root / f"expert{i}")
        subspaces.append(bases)
        model.save_pretrained(experts[-1])
    return root / "base", experts, subspaces


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def subspace_interference(merged: Path, base: dict, experts: list[dict], subspaces: list[dict]) -> list[float]:
    """Per expert: sum over its linear layers of ||(W_m - W_i) S_i||^2 / ||(W_0 - W_i) S_i||^2 (base = 1)."""
    weights = read_weights(merged)
    errors = []
    for expert, bases in zip(experts, subspaces, strict=True):
        num = sum(float(((weights[n] - expert[n]) @ S.double()).pow(2).sum()) for n, S in bases.items())
        den = sum(float(((base[n] - expert[n]) @ S.double()).pow(2).sum()) for n, S in bases.items())
        errors.append(num / den)
    return errors


def model_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.double()


def score(merged: Path, base_logits: list[torch.Tensor], expert_logits: list[torch.Tensor], tokens) -> list[float]:
    """Per-expert error_i of the merged model (see the module docstring)."""
    errors = []
    for i, (b, e) in enumerate(zip(base_logits, expert_logits, strict=True)):
        m = model_logits(merged, tokens[i])
        errors.append(float((m - e).pow(2).sum() / (b - e).pow(2).sum()))
    return errors


def run_demo(workdir: Path, methods: list[str] | None = None, seed: int = 0) -> list[dict]:
    """Build the experts in ``workdir``, merge them with each method (default: :func:`demo_methods`), one row each."""
    from specmerge.pipeline.run.api import merge

    methods = demo_methods() if methods is None else methods
    base, experts, subspaces = build_experts(workdir, seed=seed)
    base_w, expert_w = read_weights(base), [read_weights(e) for e in experts]
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 256, (8, 16), generator=g) for _ in experts]
    base_logits = [model_logits(base, t) for t in tokens]
    expert_logits = [model_logits(e, t) for e, t in zip(experts, tokens, strict=True)]
    rows = []
    for method in methods:
        out = workdir / f"merged-{method}"
        start = time.perf_counter()
        # overwrite: a second demo in the same --workdir replaces its own earlier merges (never anything else)
        report = merge(base, experts, out, method=method, progress=False, overwrite=True)
        seconds = time.perf_counter() - start
        errors = score(out, base_logits, expert_logits, tokens)
        interference = subspace_interference(out, base_w, expert_w, subspaces)
        kept = [t["diagnostics"].get("kept_rank") for t in report["tensors"] if t["action"] == "merge"]
        kept = [k for k in kept if k is not None]
        rows.append(
            {
                "method": method,
                "interference": sum(interference) / len(interference),
                "worst": max(interference),
                "logit_error": sum(errors) / len(errors),
                "mean_kept_rank": sum(kept) / len(kept) if kept else None,
                "seconds": seconds,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """The demo's table, rows sorted by own-input interference (best first)."""
    w = max(16, *(len(row["method"]) for row in rows))
    names = ("method", "own-input interference", "worst", "random-token logits", "mean K", "merge s")
    header = f"{names[0]:<{w}} {names[1]:>22} {names[2]:>7} {names[3]:>19} {names[4]:>7} {names[5]:>8}"
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: r["interference"]):
        kept = "" if row["mean_kept_rank"] is None else f"{row['mean_kept_rank']:.1f}"
        lines.append(
            f"{row['method']:<{w}} {row['interference']:>22.4f} {row['worst']:>7.4f} {row['logit_error']:>19.4f} "
            f"{kept:>7} {row['seconds']:>8.2f}"
        )
    return "\n".join(lines)


def main(seed: int = 0, workdir: str | None = None) -> None:
    """``specmerge demo``: build the tiny Llama family (in ``workdir``, else a temporary folder), merge, print."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one table, not 40 "Loading weights" bars
    methods = demo_methods()
    with tempfile.TemporaryDirectory(prefix="specmerge-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(
            f"specmerge demo: a tiny Llama and 4 experts written to {root}, merged from disk with {len(methods)} "
            "methods.\nScores (0 = the expert itself, 1 = the base model; mean, and worst, over the experts):\n"
            "  own-input interference = sum over linear layers of ||(W_merged - W_i) S_i||^2 / ||(W_0 - W_i) S_i||^2,\n"
            "    S_i the inputs expert i was tuned on (what WUDI and SWUDI minimise);\n"
            "  random-token logits = ||logits_merged - logits_i||^2 / ||logits_0 - logits_i||^2 on random tokens.\n"
        )
        rows = run_demo(root, methods, seed=seed)
        print(format_table(rows))
        print(closing_hint(workdir))


def closing_hint(workdir: str | None) -> str:
    """The demo's last lines: a merge of its models to run next, naming a folder that still exists afterwards.

    Without ``--workdir`` the models lived in a temporary folder that is gone when the demo ends, so the hint says
    how to keep them (``specmerge demo --workdir demo-models``) and names that folder.
    """
    root = workdir or "demo-models"
    if not (Path(root).is_absolute() or root.startswith((".", "~"))):
        root = f"./{root}"  # a bare 'a/b' would also read as a Hugging Face hub id
    experts = " ".join(f"{root}/expert{i}" for i in range(4))
    merge = f"specmerge merge {root}/base {experts} -o merged -m swudi_a"
    if workdir:
        return f"\nThe models are kept in {workdir}. Do one yourself:\n  {merge}"
    return (
        "\nThe models were written to a temporary folder, now removed. Do one yourself: keep them with\n"
        f"  specmerge demo --workdir demo-models\nthen\n  {merge}"
    )
