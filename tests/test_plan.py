"""The plan: merge 2-D linear weights, average the rest, keep what is not floating point; overrides first."""

from dataclasses import dataclass

import pytest
import torch

from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import PlanError, default_action, is_embedding, make_plan
from specmerge.pipeline.plan.summary import summarize
from specmerge.pipeline.recipe.model import Recipe

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64

LLAMA = [
    ("model.embed_tokens.weight", (32, 8), BF16),
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), BF16),
    ("model.layers.0.self_attn.k_proj.weight", (4, 8), BF16),
    ("model.layers.0.self_attn.v_proj.weight", (4, 8), BF16),
    ("model.layers.0.self_attn.o_proj.weight", (8, 8), BF16),
    ("model.layers.0.self_attn.q_proj.bias", (8,), BF16),
    ("model.layers.0.mlp.gate_proj.weight", (16, 8), BF16),
    ("model.layers.0.mlp.up_proj.weight", (16, 8), BF16),
    ("model.layers.0.mlp.down_proj.weight", (8, 16), BF16),
    ("model.layers.0.input_layernorm.weight", (8,), BF16),
    ("model.layers.0.post_attention_layernorm.weight", (8,), BF16),
    ("model.norm.weight", (8,), BF16),
    ("lm_head.weight", (32, 8), BF16),
]
CLIP = [
    ("vision_model.embeddings.class_embedding", (8,), F32),
    ("vision_model.embeddings.patch_embedding.weight", (8, 3, 4, 4), F32),
    ("vision_model.embeddings.position_embedding.weight", (5, 8), F32),
    ("vision_model.embeddings.position_ids", (1, 5), I64),
    ("vision_model.pre_layrnorm.weight", (8,), F32),
    ("vision_model.encoder.layers.0.self_attn.in_proj_weight", (24, 8), F32),
    ("vision_model.encoder.layers.0.self_attn.in_proj_bias", (24,), F32),
    ("vision_model.encoder.layers.0.self_attn.out_proj.weight", (8, 8), F32),
    ("vision_model.encoder.layers.0.mlp.fc1.weight", (16, 8), F32),
    ("vision_model.encoder.layers.0.mlp.fc1.bias", (16,), F32),
    ("visual_projection.weight", (4, 8), F32),
    ("logit_scale", (), F32),
]
BERT = [
    ("bert.embeddings.word_embeddings.weight", (30, 8), F32),
    ("bert.embeddings.position_embeddings.weight", (16, 8), F32),
    ("bert.embeddings.token_type_embeddings.weight", (2, 8), F32),
    ("bert.embeddings.LayerNorm.weight", (8,), F32),
    ("bert.embeddings.LayerNorm.bias", (8,), F32),
    ("bert.encoder.layer.0.attention.self.query.weight", (8, 8), F32),
    ("bert.encoder.layer.0.attention.self.query.bias", (8,), F32),
    ("bert.encoder.layer.0.attention.output.dense.weight", (8, 8), F32),
    ("bert.encoder.layer.0.output.LayerNorm.weight", (8,), F32),
    ("bert.pooler.dense.weight", (8, 8), F32),
]


@dataclass(frozen=True)
class Info:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def infos(rows, dtype=None):
    return {name: Info(name, shape, dtype if dtype and d.is_floating_point else d) for name, shape, d in rows}


def plan_for(rows, experts=2, expert_dtype=None, **fields):
    recipe = Recipe.from_dict({"base": "base", "experts": [f"e{i}" for i in range(experts)], **fields})
    expert_infos = [infos(rows, expert_dtype) for _ in range(experts)]
    plan = make_plan(recipe, infos(rows), expert_infos, recipe.experts)
    return {p.name: p for p in plan}, plan


def decisions(plan):
    return {name: (p.action, p.method) for name, p in plan.items()}


def test_llama_with_a_matrix_method_merges_linear_weights_and_averages_the_rest():
    plan, ordered = plan_for(LLAMA)  # swudi_a
    assert [p.name for p in ordered] == [name for name, _, _ in LLAMA]  # the base's order
    merged = {name for name, p in plan.items() if p.action == "merge"}
    assert merged == {n for n, _, _ in LLAMA if n.endswith("_proj.weight")}
    assert plan["model.embed_tokens.weight"].action == "average"  # a method of linear layers: as in its paper
    assert plan["model.embed_tokens.weight"].reason == "embedding; a method of linear layers"
    assert plan["lm_head.weight"].action == "average"
    assert plan["model.layers.0.input_layernorm.weight"].reason == "norm/bias (1-D)"
    assert plan["model.layers.0.self_attn.q_proj.bias"].action == "average"
    q = plan["model.layers.0.self_attn.q_proj.weight"]
    assert (q.method, q.reason, q.out_dtype) == ("swudi_a", "2-D linear weight", BF16)
    assert q.params == {"rule": "psqrt", "tau_init": "sum", "scale": 1.0}


def test_elementwise_methods_take_every_tensor_and_embeddings_unless_told_not_to():
    plan, _ = plan_for(LLAMA, method="ties")  # merge_embeddings unset: the method's convention, as mergekit
    assert all((p.action, p.method) == ("merge", "ties") for p in plan.values())
    ties_defaults = {"scale": 1.0, "normalize": True, "rescale": False, "convention": "paper"}
    assert plan["model.norm.weight"].params == {"density": 0.2, **ties_defaults}
    plan, _ = plan_for(LLAMA, method="ties", merge_embeddings=False)
    for name, p in plan.items():
        if is_embedding(name):
            assert (p.action, p.reason) == ("average", "embedding; merge_embeddings: false"), name
        else:
            assert (p.action, p.method) == ("merge", "ties"), name


def test_merge_embeddings_gives_embeddings_the_method_where_it_applies():
    plan, _ = plan_for(LLAMA, merge_embeddings=True)
    assert decisions(plan)["model.embed_tokens.weight"] == ("merge", "swudi_a")
    assert decisions(plan)["lm_head.weight"] == ("merge", "swudi_a")
    clip, _ = plan_for(CLIP, merge_embeddings=True)
    assert clip["vision_model.embeddings.position_embedding.weight"].action == "merge"
    # a matrix method cannot take the 4-D patch conv or the 1-D class embedding
    assert clip["vision_model.embeddings.patch_embedding.weight"].action == "average"
    assert clip["vision_model.embeddings.patch_embedding.weight"].reason == "embedding, 4-D tensor"
    assert clip["vision_model.embeddings.class_embedding"].action == "average"
    ties, _ = plan_for(CLIP, method="ties", merge_embeddings=True)
    assert decisions(ties)["vision_model.embeddings.patch_embedding.weight"] == ("merge", "ties")


def test_clip_tower():
    plan, _ = plan_for(CLIP, method="swudi", non_matrix="keep_base")
    assert decisions(plan) == {
        "vision_model.embeddings.class_embedding": ("keep_base", None),
        "vision_model.embeddings.patch_embedding.weight": ("keep_base", None),
        "vision_model.embeddings.position_embedding.weight": ("keep_base", None),  # swudi: a method of linear layers
        "vision_model.embeddings.position_ids": ("keep_base", None),
        "vision_model.pre_layrnorm.weight": ("keep_base", None),
        "vision_model.encoder.layers.0.self_attn.in_proj_weight": ("merge", "swudi"),  # fused qkv: one 2-D layer
        "vision_model.encoder.layers.0.self_attn.in_proj_bias": ("keep_base", None),
        "vision_model.encoder.layers.0.self_attn.out_proj.weight": ("merge", "swudi"),
        "vision_model.encoder.layers.0.mlp.fc1.weight": ("merge", "swudi"),
        "vision_model.encoder.layers.0.mlp.fc1.bias": ("keep_base", None),
        "visual_projection.weight": ("merge", "swudi"),
        "logit_scale": ("keep_base", None),
    }
    assert plan["vision_model.embeddings.position_ids"].reason == "not floating point"
    assert plan["logit_scale"].reason == "scalar"
    ties, _ = plan_for(CLIP, method="ties")
    assert decisions(ties)["vision_model.embeddings.position_ids"] == ("keep_base", None)
    assert decisions(ties)["vision_model.encoder.layers.0.self_attn.in_proj_bias"] == ("merge", "ties")
    assert ties["vision_model.embeddings.patch_embedding.weight"].action == "merge"  # elementwise: embeddings too


def test_bert():
    plan, _ = plan_for(BERT)
    assert {n for n, p in plan.items() if p.action == "merge"} == {
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.output.dense.weight",
        "bert.pooler.dense.weight",
    }
    assert plan["bert.embeddings.word_embeddings.weight"].reason == "embedding; a method of linear layers"
    assert plan["bert.embeddings.token_type_embeddings.weight"].reason == "embedding; a method of linear layers"
    # the LayerNorm inside the embeddings block is a norm, not an embedding: the elementwise method takes it
    assert not is_embedding("bert.embeddings.LayerNorm.weight")
    ties, _ = plan_for(BERT, method="ties")
    assert decisions(ties)["bert.embeddings.LayerNorm.weight"] == ("merge", "ties")


@pytest.mark.parametrize(
    "name",
    [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "shared.weight",
        "encoder.embed_tokens.weight",
        "gpt_neox.embed_in.weight",
        "embed_out.weight",
        "model.decoder.embed_positions.weight",
        "text_model.embeddings.token_embedding.weight",
        "visual.positional_embedding",
        "patch_embed.proj.weight",
        "cls_token",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "backbone.embeddings.weight",
        "output.weight",
        "cls.predictions.decoder.weight",
    ],
)
def test_is_embedding(name):
    assert is_embedding(name)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.shared_expert.gate_proj.weight",
        "bert.encoder.layer.0.attention.output.dense.weight",
        "decoder.block.0.layer.1.EncDecAttention.q.weight",
        "visual_projection.weight",
        "model.norm.weight",
    ],
)
def test_is_not_embedding(name):
    assert not is_embedding(name)


def test_default_action_directly():
    r = Recipe(base="b", experts=["e"])
    swudi_a, ties = get_method("swudi_a"), get_method("ties")
    assert default_action("h.0.attn.c_attn.weight", (8, 24), F32, swudi_a, r) == ("merge", "2-D linear weight")
    assert default_action("h.0.attn.c_attn.bias", (24,), F32, swudi_a, r) == ("average", "norm/bias (1-D)")
    assert default_action("visual.proj", (8, 4), F32, swudi_a, r) == ("average", "2-D, not named weight")
    assert default_action("visual.proj", (8, 4), F32, ties, r) == ("merge", "2-D, not named weight")
    assert default_action("conv.weight", (8, 3, 3, 3), F32, swudi_a, r) == ("average", "4-D tensor")
    assert default_action("mask", (8, 8), torch.bool, ties, r) == ("keep_base", "not floating point")


def test_overrides_come_first_and_the_first_match_wins():
    plan, _ = plan_for(
        LLAMA,
        method="swudi_a",
        overrides=[
            {"pattern": "*.mlp.down_proj.weight", "action": "keep_base"},
            {"pattern": "*.mlp.*", "method": "ties", "params": {"density": 0.5}},
            {"pattern": "model.embed_tokens.weight", "params": {"rule": "gavish_donoho"}},
            {"pattern": "*layernorm*", "action": "keep_base"},
        ],
    )
    down = plan["model.layers.0.mlp.down_proj.weight"]
    assert (down.action, down.reason, down.params) == ("keep_base", "override '*.mlp.down_proj.weight'", {})
    up = plan["model.layers.0.mlp.up_proj.weight"]
    assert (up.action, up.method, up.params, up.reason) == (
        "merge",
        "ties",
        {"density": 0.5, "scale": 1.0, "normalize": True, "rescale": False, "convention": "paper"},
        "override '*.mlp.*'",
    )
    embed = plan["model.embed_tokens.weight"]
    assert (embed.action, embed.method, embed.params["rule"]) == ("merge", "swudi_a", "gavish_donoho")
    assert plan["model.layers.0.input_layernorm.weight"].action == "keep_base"
    assert plan["model.norm.weight"].action == "average"  # not matched by '*layernorm*'
    assert plan["model.layers.0.self_attn.q_proj.weight"].method == "swudi_a"


def test_overrides_cannot_average_integer_tensors():
    plan, _ = plan_for(CLIP, overrides=[{"pattern": "*", "action": "average"}])
    assert plan["vision_model.embeddings.position_ids"].action == "keep_base"
    assert plan["vision_model.encoder.layers.0.mlp.fc1.weight"].action == "average"


def test_a_matrix_method_on_a_1d_tensor_by_override_is_an_error():
    with pytest.raises(PlanError) as err:
        plan_for(LLAMA, method="ties", overrides=[{"pattern": "*.self_attn.*", "method": "swudi_a"}])
    message = str(err.value)
    assert "override '*.self_attn.*'" in message and "'model.layers.0.self_attn.q_proj.bias'" in message
    assert "(8,)" in message and "'swudi_a'" in message and "needs 2-D weights" in message


def test_an_override_that_matches_nothing_is_an_error():
    with pytest.raises(PlanError, match=r"override '\*\.mpl\.\*' matches no tensor of the base \(names look like"):
        plan_for(LLAMA, overrides=[{"pattern": "*.mpl.*", "action": "keep_base"}])


def test_averages_carry_the_scale_only_when_asked():
    plan, _ = plan_for(LLAMA, method="task_arithmetic", params={"scale": 0.4}, merge_embeddings=False)
    assert plan["lm_head.weight"].params == {"scale": 1.0}
    assert plan["model.norm.weight"].params == {"scale": 0.4}  # elementwise: merged with the method
    plan, _ = plan_for(LLAMA, params={"scale": 0.4}, scale_non_matrix=True)
    assert plan["model.norm.weight"].params == {"scale": 0.4}
    assert plan["model.norm.weight"].action == "average"
    assert plan["model.layers.0.self_attn.q_proj.weight"].params["scale"] == 0.4


def test_shape_mismatch_and_missing_tensors_name_the_tensor_and_the_expert():
    recipe = Recipe(base="base", experts=["math", "code"])
    base = infos(LLAMA)
    resized = dict(base, **{"model.embed_tokens.weight": Info("model.embed_tokens.weight", (40, 8), BF16)})
    with pytest.raises(PlanError) as err:
        make_plan(recipe, base, [base, resized], ["/m/math", "/m/code"])
    assert str(err.value).startswith(
        "tensor 'model.embed_tokens.weight' has shape (40, 8) in expert '/m/code' but (32, 8) in the base"
    )
    # keep_base tensors are not read from the experts, so an override resolves it
    fixed = Recipe(base="base", experts=["math", "code"], overrides=[{"pattern": "*embed*", "action": "keep_base"}])
    assert len(make_plan(fixed, base, [base, resized], ["/m/math", "/m/code"])) == len(LLAMA)

    missing = {k: v for k, v in base.items() if k != "model.norm.weight"}
    with pytest.raises(PlanError, match=r"tensor 'model.norm.weight' is in the base but not in expert '/m/math'"):
        make_plan(recipe, base, [missing, base], ["/m/math", "/m/code"])
    extra = dict(base, **{"score.weight": Info("score.weight", (2, 8), F32)})
    with pytest.raises(
        PlanError, match=r"'score.weight' is in expert '/m/code' but not in the base: it would be dropped"
    ):
        make_plan(recipe, base, [base, extra], ["/m/math", "/m/code"])
    both = {k: v for k, v in resized.items() if k != "model.norm.weight"}
    with pytest.raises(PlanError, match=r"and 1 more such problems"):
        make_plan(recipe, base, [base, both], ["/m/math", "/m/code"])


def test_dtype_rules():
    plan, _ = plan_for(CLIP, expert_dtype=BF16)  # bf16 experts of an fp32 base are fine
    assert plan["vision_model.encoder.layers.0.mlp.fc1.weight"].out_dtype == F32  # auto = the base's dtype
    plan, _ = plan_for(CLIP, dtype="bfloat16")
    assert plan["vision_model.encoder.layers.0.mlp.fc1.weight"].out_dtype == BF16
    assert plan["vision_model.pre_layrnorm.weight"].out_dtype == BF16
    assert plan["vision_model.embeddings.position_ids"].out_dtype == I64  # non-floating keep theirs


def test_summarize_counts_tensors_and_bytes():
    _, plan = plan_for(LLAMA)
    summary = summarize(plan)
    total = sum(torch.Size(shape).numel() * 2 for _, shape, _ in LLAMA)  # bf16
    assert summary["tensors"] == len(LLAMA) and summary["bytes"] == total
    assert summary["by_action"]["merge"] == {"tensors": 7, "bytes": 2 * (64 + 32 + 32 + 64 + 3 * 128)}
    assert summary["by_method"] == {"swudi_a": summary["by_action"]["merge"]}
    assert summary["by_action"]["average"]["tensors"] == 6
    assert summary["by_reason"]["embedding; a method of linear layers"]["tensors"] == 2
