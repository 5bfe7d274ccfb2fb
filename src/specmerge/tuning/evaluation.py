"""Scoring a merged model: a shell command (``--eval CMD``) or a Python callable.

A command gets the model folder in place of ``{model}`` (quoted for the shell) and, with successive halving, the
share of its evaluation to run in place of ``{budget}`` (a number in (0, 1]). It prints the score as its last line
of output: one number, or a JSON object from which ``metric`` is read (the only number in it when no metric is
named). A non-zero exit, or a last line that is neither, stops the tune with one line that quotes it.

A callable gets the model: the folder (a :class:`pathlib.Path`) when the candidates are written to disk, the merged
state dict (name -> tensor, what the folder's shards hold) when they are kept in memory, or with ``module=`` that
module with the merged weights loaded into it (``load_state_dict``, strict) either way; and ``budget=`` when it
accepts that keyword. It returns a number or a mapping of named numbers.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

Candidate = Path | Mapping[str, torch.Tensor]  # a merged model: its folder, or its state dict in memory
Evaluate = Callable[[Candidate, float], dict[str, float]]  # (the model, budget) -> named scores


class EvaluationError(ValueError):
    """The evaluation failed or printed no score: the tune stops (scores so far are kept)."""


def score_of(value: Any, metric: str | None, source: str) -> tuple[float, dict[str, float]]:
    """(the score, every named number) from what an evaluation gave: a number, or a mapping with ``metric``."""
    if isinstance(value, Mapping):
        numbers = {str(k): _float(v) for k, v in value.items() if _number(v)}
        if metric is None:
            if len(numbers) != 1:
                raise EvaluationError(f"{source} gave {dict(value)}: name the score with --metric (one of "
                                      f"{', '.join(numbers) or 'none: no number in it'})")  # fmt: skip
            metric = next(iter(numbers))
        if metric not in numbers:
            raise EvaluationError(f"{source} gave no number named '{metric}' (got {dict(value)})")
        score = numbers[metric]
    elif _number(value):
        score, numbers = _float(value), {}
    else:
        raise EvaluationError(f"{source} gave {value!r}: return a number or a mapping of named numbers")
    if not math.isfinite(score):
        raise EvaluationError(f"{source} gave a score of {score}: it must be a finite number")
    return score, numbers


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _float(value: int | float) -> float:
    """``value`` as a float; an integer beyond float's range (a 400-digit score) is infinite, refused as such."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def run_command(line: str, timeout: float | None) -> subprocess.CompletedProcess:
    """``line`` through the shell in a process group of its own, so that a timeout stops the evaluation's children
    too (killing the shell alone leaves them running)."""
    process = subprocess.Popen(
        line, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:  # the timeout, or Ctrl-C: the whole group goes
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(line, process.returncode, stdout, stderr)


def command_evaluator(command: str, metric: str | None = None, *, timeout: float | None = None) -> Evaluate:
    """An evaluation running ``command`` through the shell with ``{model}`` (and ``{budget}``) filled in."""
    if "{model}" not in command:
        raise ValueError(f"--eval command must contain {{model}} (where the model folder goes), got {command!r}")

    def evaluate(model: Candidate, budget: float) -> dict[str, float]:
        if not isinstance(model, Path):
            raise TypeError("a command evaluates a model folder: write the candidates to disk")
        line = command.replace("{model}", shlex.quote(str(model))).replace("{budget}", repr(float(budget)))
        try:
            done = run_command(line, timeout)
        except subprocess.TimeoutExpired:
            raise EvaluationError(f"--eval command ran longer than {timeout} s on {model}: {line}") from None
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise EvaluationError(f"--eval command exited with {done.returncode} on {model}: {tail[0]} ({line})")
        lines = [text.strip() for text in done.stdout.splitlines() if text.strip()]
        if not lines:
            raise EvaluationError(f"--eval command printed nothing on {model}; it must print the score last ({line})")
        last = lines[-1]
        try:
            value = json.loads(last)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: JSON nested thousands deep
            raise EvaluationError(
                f"--eval command's last line is not a number or a JSON object: {last[:200]!r} ({line})"
            ) from None
        score, numbers = score_of(value, metric, "--eval command")
        return {"score": score, **numbers}

    return evaluate


def uses_budget(command: str) -> bool:
    return "{budget}" in command


def takes_budget(fn: Callable[..., Any]) -> bool:
    """Whether the Python evaluation ``fn`` accepts the share of the evaluation as ``budget=``."""
    return "budget" in inspect.signature(fn).parameters


def callable_evaluator(
    fn: Callable[..., Any], metric: str | None = None, *, module: torch.nn.Module | None = None
) -> Evaluate:
    """An evaluation calling ``fn`` with the model (folder or state dict), or ``module`` holding its weights."""
    with_budget = takes_budget(fn)

    def evaluate(model: Candidate, budget: float) -> dict[str, float]:
        subject: Any = model if module is None else load_into(module, model)
        value = fn(subject, budget=budget) if with_budget else fn(subject)
        score, numbers = score_of(value, metric, f"evaluate({getattr(fn, '__name__', 'fn')})")
        return {"score": score, **numbers}

    return evaluate


def load_into(module: torch.nn.Module, model: Candidate) -> torch.nn.Module:
    """``module`` with the weights of the model (a folder, or a state dict) loaded (strict: every name must match,
    one line if not)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    if isinstance(model, Path):
        for file in sorted(model.glob("*.safetensors")):
            state.update(load_file(file))
    else:
        state = dict(model)
    result = module.load_state_dict(state, strict=False)
    buffers = {name for name, _ in module.named_buffers()}
    missing = [n for n in result.missing_keys if n not in buffers]
    if missing or result.unexpected_keys:
        raise EvaluationError(
            f"the merged model's tensors do not match the module given: missing {missing[:3]}, unexpected "
            f"{result.unexpected_keys[:3]}: pass the module of the base model's architecture"
        )
    return module
