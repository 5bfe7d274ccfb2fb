"""The model card (README.md) written into a merged model or adapter folder."""

from __future__ import annotations

from specmerge.pipeline.recipe import Recipe
from specmerge.version import __version__


def model_card(recipe: Recipe, citation: str) -> str:
    """A short README.md for the merged model or adapter: what was merged, how, and the recipe to redo it."""
    experts = "\n".join(f"- `{e}`" for e in recipe.experts)
    if recipe.output_format == "lora":
        title = "Merged LoRA adapter"
        usage = (
            "A PEFT LoRA adapter of the base model (exact merge"
            + (f", modules truncated to rank {recipe.max_rank}" if recipe.max_rank else "")
            + "):\n\n```python\nfrom peft import PeftModel\n"
            "model = PeftModel.from_pretrained(base_model, path_to_this_folder)\n```\n\n"
        )
    else:
        title, usage = "Merged model", ""
    return (
        "---\ntags:\n- merge\n- specmerge\n---\n\n"
        f"# {title}\n\nBase model: `{recipe.base}`\n\nExperts:\n{experts}\n\n"
        f"Merged with specmerge {__version__}, method `{recipe.method}` ({citation}).\n\n{usage}"
        "Per-tensor diagnostics (kept rank, spectrum, time) are in `report.json`.\n\n"
        f"## Recipe\n\n```yaml\n{recipe.to_yaml()}```\n"
    )
