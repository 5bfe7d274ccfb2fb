"""An evaluation for ``specmerge tune`` tests: the perplexity of a tiny causal LM on fixed held-out token sequences.

``python tests/tune_eval.py MODEL`` prints ``{"perplexity": ..., "nll": ...}`` as its last line;
``python tests/tune_eval.py --bigram MODEL`` the cheaper ``{"nll": ...}`` of a bigram model made of the embedding,
the first layer's MLP and the head (no transformers import, for the tests that only need some real score). For
the resume test, each call appends the model folder's setting to $TUNE_EVAL_LOG (if set), and the call number
$TUNE_EVAL_FAIL_AT (1-based, counted in that log) exits with status 3 before scoring, as an interruption would.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch


def held_out(vocab: int = 64, sequences: int = 6, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (sequences, length), generator=torch.Generator().manual_seed(1234))


def perplexity(model: torch.nn.Module) -> dict[str, float]:
    """exp of the mean next-token negative log-likelihood on :func:`held_out`."""
    tokens = held_out()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[:, :-1].double()
    nll = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
    return {"perplexity": math.exp(nll), "nll": nll}


def bigram_nll(folder: str) -> dict[str, float]:
    """The next-token NLL on :func:`held_out` of logits = lm_head(h + mlp_0(h)), h = embed(token)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / "model.safetensors"))
    tokens = held_out()
    h = state["model.embed_tokens.weight"][tokens[:, :-1]]
    mlp = "model.layers.0.mlp."
    gated = torch.nn.functional.silu(h @ state[mlp + "gate_proj.weight"].T) * (h @ state[mlp + "up_proj.weight"].T)
    h = h + gated @ state[mlp + "down_proj.weight"].T
    logits = (h @ state["lm_head.weight"].T).double()
    nll = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
    return {"nll": nll}


def main(folder: str, bigram: bool = False) -> int:
    log = os.environ.get("TUNE_EVAL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(Path(folder).name + "\n")
        fail_at = os.environ.get("TUNE_EVAL_FAIL_AT")
        if fail_at and len(Path(log).read_text().splitlines()) == int(fail_at):
            print("interrupted on purpose", file=sys.stderr)
            return 3
    if bigram:
        print(json.dumps(bigram_nll(folder)))
        return 0
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    print(json.dumps(perplexity(model)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1], bigram="--bigram" in sys.argv[1:-1]))
