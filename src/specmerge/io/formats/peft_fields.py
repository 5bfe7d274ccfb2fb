"""Every field PEFT's ``LoraConfig`` writes into ``adapter_config.json``, and what specmerge does with it.

A LoRA adapter is merged as the delta s B A of each adapted weight (:mod:`.peft`). The fields of PEFT 0.21's
``LoraConfig`` (``peft/tuners/lora/config.py``) fall in three groups: those that set that delta (read by
:func:`~specmerge.io.formats.peft.lora_settings`), those that do not change what a saved adapter's weights mean
(training settings, which modules were targeted, bookkeeping: :data:`NO_EFFECT`), and those that, when set, make the
adapter something other than s B A on the base given (:data:`REFUSED`): each is refused by name with what it does.
A field this table does not know (a newer PEFT) is refused when set, so that no adapter is merged as a plain LoRA
while its config says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specmerge.io.formats.protocol import SourceError


class AdapterError(SourceError):
    """A PEFT adapter that cannot be read or does not fit the base model."""


SETS_DELTA = frozenset(
    {"peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "fan_in_fan_out"}
)
# read as merge_and_unload makes of them (specmerge.io.formats.peft_variants)
VARIANTS = frozenset({"use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters"})
NO_EFFECT = frozenset(
    {
        "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
        "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
        "megatron_core", "runtime_config", "eva_config", "qalora_group_size", "ensure_weight_tying",
    }
)  # fmt: skip
MERGE_FIRST = "merge the adapter into the model with PEFT's merge_and_unload and pass the full checkpoint"
CONVERT = (
    "save it converted to a plain LoRA with PEFT (save_pretrained(..., path_initial_model_for_weight_conversion=...))"
)
REFUSED: dict[str, tuple[str, str]] = {  # field -> (what it makes the adapter, what to do)
    "megatron_config": ("Megatron-parallel LoRA layers", MERGE_FIRST),
    "velora_config": ("VeLoRA layers", MERGE_FIRST),
    "kasa_config": ("KaSA: a learned singular-value diagonal between the factors", MERGE_FIRST),
    "monteclora_config": ("MonteCLoRA: factors sampled around a learned mean", MERGE_FIRST),
    "use_bdlora": ("BD-LoRA: block-diagonal factors", MERGE_FIRST),
    "layer_replication": (
        "a model whose base layers are repeated",
        "merge_and_unload gives a model with more layers than the base; merge such models as bases of their own",
    ),
    "alora_invocation_tokens": (
        "an activated LoRA, which acts only after its invocation tokens; baked into weights it would act on every "
        "token",
        "no merged model behaves as it does",
    ),
    "arrow_config": ("Arrow: a router choosing among LoRA experts per token", "no merged model behaves as it does"),
    "use_qalora": ("QA-LoRA: an update of group-pooled inputs to a quantized base", "merge it into its base with PEFT"),
    "loftq_config": ("LoftQ: an adapter trained against a quantized copy of the base", "merge it into that base"),
    "corda_config": ("CorDA initialisation, which changes the base weights the adapter is relative to", CONVERT),
    "lora_ga_config": ("LoRA-GA initialisation, which changes the base weights the adapter is relative to", CONVERT),
}
INITS_CHANGING_BASE = ("pissa", "olora", "corda", "lora_ga", "loftq")  # init_lora_weights that rewrite W_0
ALLOWED_VALUES = {"bias": ("none",)}


def is_set(value: Any) -> bool:
    """Whether a config value asks for something (not null, false, empty or zero)."""
    return value not in (None, False, "", 0) and not (isinstance(value, list | dict | tuple) and not value)


def check_fields(config: Mapping[str, Any], config_file: str) -> None:
    """Refuse an adapter config with a field set that makes the adapter more than a LoRA delta of the base."""
    for key, value in config.items():
        if key in SETS_DELTA or key in NO_EFFECT or key in VARIANTS:
            continue
        shown = f"{value!r}"[:60]
        if key in ALLOWED_VALUES:
            if value not in ALLOWED_VALUES[key]:
                raise AdapterError(
                    f"{config_file}: 'bias' is {shown}: the adapter trained the layers' biases, which specmerge does "
                    f"not merge yet; {MERGE_FIRST}"
                )
        elif key == "init_lora_weights":
            if isinstance(value, str) and value.lower().startswith(INITS_CHANGING_BASE):
                raise AdapterError(
                    f"{config_file}: init_lora_weights is {shown}, an initialisation that subtracts the initial "
                    f"factors from the base weights, so this adapter is relative to a changed base; {CONVERT}"
                )
        elif key in REFUSED:
            if is_set(value):
                what, fix = REFUSED[key]
                raise AdapterError(
                    f"{config_file}: '{key}' is {shown}: the adapter is {what}, which specmerge does not merge; {fix}"
                )
        elif is_set(value):
            raise AdapterError(
                f"{config_file}: '{key}' is {shown}, a field specmerge does not know (from a newer PEFT?), so it "
                f"cannot tell what the adapter is: {MERGE_FIRST}"
            )


def config_object(config: Any, name: str) -> dict[str, Any]:
    """``config`` if it is a JSON object (a dict), else a one-line error naming ``name``."""
    if not isinstance(config, dict):
        raise AdapterError(
            f"{name}: a PEFT adapter config is a JSON object (peft_type, r, lora_alpha, ...), "
            f"got a {type(config).__name__}"
        )
    return config
