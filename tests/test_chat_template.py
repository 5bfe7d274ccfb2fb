"""The merged model's chat template (issue 51, silent difference 6): instruct experts that agree on a template,
merged over a base without one, give a model with their template, said on the console; experts that disagree are
refused before anything is written, with what to write; ``chat_template`` chooses one (base, an expert, a file, a
text), and transformers loads the output with it."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import transformers

import specmerge
from specmerge.errors import RecipeError
from specmerge.io.output.folder import OUTPUT_LOG
from specmerge.pipeline.recipe.model import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_family
from token_models import example

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A base with a tokenizer and no chat template, and three experts with its tokenizer files, no template yet."""
    root = tmp_path_factory.mktemp("chat")
    base, experts = build_family(root, "llama", 3)
    example.word_tokenizer().save_pretrained(base)
    for expert in experts:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / name, expert / name)
    return base, experts


def with_templates(tmp_path: Path, family, templates: list[str | None], *, old_style: bool = False) -> list[Path]:
    """Copies of the experts, expert i carrying ``templates[i]`` (in chat_template.jinja, or tokenizer_config.json)."""
    _, experts = family
    out = []
    for i, (expert, template) in enumerate(zip(experts, templates, strict=True)):
        copy = tmp_path / f"expert{i}"
        shutil.copytree(expert, copy)
        if template is not None and old_style:
            config = json.loads((copy / "tokenizer_config.json").read_text())
            (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        elif template is not None:
            (copy / "chat_template.jinja").write_text(template)
        out.append(copy)
    return out


def merged(base: Path, experts: list[Path], out: Path, caplog, **options) -> tuple[str | None, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=OUTPUT_LOG):
        report = specmerge.merge(base, experts, out, method="task_arithmetic", progress=False, **options)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat template:")]
    assert report.get("chat_template") == (said[0].removeprefix("chat template: ") if said else None)
    return transformers.AutoTokenizer.from_pretrained(out).chat_template, said


@pytest.mark.parametrize("old_style", [False, True])
def test_experts_that_agree_give_their_template_over_a_base_without_one(tmp_path, family, caplog, old_style):
    base, _ = family
    experts = with_templates(tmp_path, family, [CHATML, CHATML, None], old_style=old_style)
    template, said = merged(base, experts, tmp_path / "out", caplog)
    assert template == CHATML
    assert said == ["chat template: the experts' (expert0, expert1; none in expert2)"]


def test_experts_that_disagree_are_refused_before_anything_is_written(tmp_path, family):
    base, _ = family
    experts = with_templates(tmp_path, family, [CHATML, None, OTHER])
    with pytest.raises(RecipeError, match="experts 'expert0' and 'expert2' carry different chat templates"):
        specmerge.merge(base, experts, tmp_path / "out", method="task_arithmetic", progress=False)
    assert not (tmp_path / "out").exists()


def test_chat_template_chooses_base_an_expert_a_file_or_a_text(tmp_path, family, caplog):
    base, _ = family
    experts = with_templates(tmp_path, family, [CHATML, None, OTHER])
    (tmp_path / "mine.jinja").write_text(OTHER + "!")
    cases = {
        "base": (None, "the base's"),
        "expert2": (OTHER, "expert 'expert2''s"),
        str(tmp_path / "mine.jinja"): (OTHER + "!", f"the file {tmp_path / 'mine.jinja'}"),
        CHATML: (CHATML, "the recipe's chat_template text"),
    }
    for k, (choice, (expected, source)) in enumerate(cases.items()):
        template, said = merged(base, experts, tmp_path / f"out{k}", caplog, chat_template=choice)
        assert template == expected and said == [f"chat template: {source}"]


def test_no_template_anywhere_says_nothing_and_a_bad_choice_is_one_line(tmp_path, family, caplog):
    base, experts = family
    template, said = merged(base, experts, tmp_path / "out", caplog)
    assert template is None and said == []
    with pytest.raises(RecipeError, match="specmerge has no built-in templates"):
        specmerge.merge(base, experts, tmp_path / "bad", method="task_arithmetic", chat_template="chatml")
    with pytest.raises(RecipeError, match="option 'chat_template' does not apply to an in-memory merge"):
        specmerge.merge_state_dicts({}, [{}], chat_template="base")


def test_an_adapter_has_no_chat_template_to_choose():
    with pytest.raises(RecipeError, match="chat_template applies to a merged model"):
        Recipe.from_dict({"base": "base", "experts": ["a"], "output_format": "lora", "chat_template": "base"})
