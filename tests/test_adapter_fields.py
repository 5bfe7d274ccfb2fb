"""Every adapter_config.json field is honoured or refused by name (issue 48, item 5): an activated LoRA, a
replicated-layer adapter or a QA-LoRA is never merged as a plain LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest

from specmerge.io.formats.peft import open_adapter
from specmerge.io.formats.peft_fields import NO_EFFECT, REFUSED, SETS_DELTA, AdapterError, check_fields
from tiny_models import build_family, save_adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fields")
    base, _ = build_family(root, "llama", n_experts=0)
    return save_adapter(base, root / "lora", 1, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])


def with_config(adapter: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "changed"
    folder.mkdir()
    for f in adapter.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


SET = {  # a value that turns each refused field on, as PEFT writes it
    "megatron_config": {"tensor_model_parallel_size": 2},
    "velora_config": {"num_groups": 4},
    "kasa_config": {"r": 2},
    "monteclora_config": {"n": 4},
    "use_bdlora": {"block": 2},
    "layer_replication": [[0, 2], [1, 2]],
    "alora_invocation_tokens": [101, 7],
    "arrow_config": {"top_k": 2},
    "use_qalora": True,
    "loftq_config": {"loftq_bits": 4},
    "corda_config": {"cache_file": "x"},
    "lora_ga_config": {"batch_size": 2},
}


def test_every_refused_field_has_a_case():
    assert set(SET) == set(REFUSED)


@pytest.mark.parametrize("field", sorted(SET))
def test_a_field_that_changes_what_the_adapter_is_is_refused_by_name(adapter, tmp_path, field):
    with pytest.raises(AdapterError, match=f"'{field}' is ") as err:
        open_adapter(with_config(adapter, tmp_path, **{field: SET[field]}))
    assert "\n" not in str(err.value) and REFUSED[field][0] in str(err.value)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"init_lora_weights": "pissa_niter_4"}, "relative to a changed base"),
        ({"init_lora_weights": "olora"}, "relative to a changed base"),
        ({"bias": "lora_only"}, "'bias' is 'lora_only'"),
        ({"some_future_knob": 3}, "'some_future_knob' is 3, a field specmerge does not know"),
    ],
)
def test_other_fields_that_change_the_adapter(adapter, tmp_path, changes, expected):
    with pytest.raises(AdapterError, match=expected):
        open_adapter(with_config(adapter, tmp_path, **changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"init_lora_weights": "gaussian"},
        {"init_lora_weights": False},
        {"some_future_knob": False},
        {"use_dora": False, "modules_to_save": None, "layer_replication": None, "alora_invocation_tokens": None},
        {"use_dora": True, "lora_bias": True},  # read as merge_and_unload makes them (tests/test_peft_variants.py)
        {"lora_dropout": 0.1, "layers_to_transform": [0], "exclude_modules": ["k_proj"], "eva_config": {"rho": 2}},
    ],
)
def test_fields_left_at_their_defaults_or_without_effect_are_accepted(adapter, tmp_path, changes):
    with open_adapter(with_config(adapter, tmp_path, **changes)) as opened:
        assert opened.modules()


def test_peft_own_default_config_is_accepted():
    """Whatever this PEFT writes for a plain LoRA passes; each field it writes is in one of the tables, or unset."""
    written = peft.LoraConfig(r=4, target_modules=["q_proj"]).to_dict()
    check_fields({k: v.value if hasattr(v, "value") else v for k, v in written.items()}, "adapter_config.json")
    known = SETS_DELTA | NO_EFFECT | set(REFUSED) | {"bias", "init_lora_weights"}
    assert "use_dora" in written and set(written) & known
