"""An evaluation for ``specmerge tune`` tests: the perplexity of a tiny causal LM on fixed held-out token sequences.

``python tests/tune_eval.py MODEL`` prints ``{"perplexity": ..., "nll": ...}`` as its last line. For the resume
test, each call appends the model folder's setting to $TUNE_EVAL_LOG (if set), and the call number $TUNE_EVAL_FAIL_AT
(1-based, counted in that log) exits with status 3 before scoring, as an interruption would.
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


def main(folder: str) -> int:
    log = os.environ.get("TUNE_EVAL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(Path(folder).name + "\n")
        fail_at = os.environ.get("TUNE_EVAL_FAIL_AT")
        if fail_at and len(Path(log).read_text().splitlines()) == int(fail_at):
            print("interrupted on purpose", file=sys.stderr)
            return 3
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    print(json.dumps(perplexity(model)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
