"""Another tool's words are explained, never guessed at; a boolean is never a number (issue 51, difference 5).

A user carrying a mergekit config over typed ``rescale: false`` and was asked "did you mean 'scale'?"; then
``scale: false`` was taken as 0.0 and the output was the base, exit 0. Each case here must be refused in one line
that says what the name means and what to write instead.
"""

from __future__ import annotations

import pytest

from specmerge.errors import RecipeError
from specmerge.methods import get_method
from specmerge.pipeline.recipe.model import Recipe

INPUTS = {"base": "base", "experts": ["a", "b"]}


def refused(data: dict) -> str:
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict({**INPUTS, **data})
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"method": "task_arithmetic", "params": {"scale": False}}, "a boolean is never read as a number"),
        ({"method": "ties", "params": {"density": True}}, "a boolean is never read as a number"),
        ({"method": "slerp", "experts": ["a"], "params": {"t": [0.2, False]}}, "a boolean is never read as a number"),
        ({"method": "ties", "overrides": [{"pattern": "*mlp*", "params": {"scale": False}}]}, "never read as a number"),
        ({"method": "ties", "expert_weights": [True, 1.0]}, "expert_weights[0] is true"),
        ({"method": "ties", "experts": [{"path": "a", "weight": False}, "b"]}, "expert_weights[0] is false"),
    ],
)
def test_a_boolean_is_never_a_number(data, says):
    assert says in refused(data)


def test_a_switch_still_takes_a_boolean():
    recipe = Recipe.from_dict({**INPUTS, "method": "linear", "params": {"normalize": False}})
    assert recipe.params["normalize"] is False


@pytest.mark.parametrize(
    ("data", "says", "not_says"),
    [
        ({"method": "swudi", "params": {"rescale": False}}, "this method drops nothing to rescale", "scale'?"),
        ({"method": "ties", "params": {"lambda": 0.5}}, "specmerge's is 'scale'", "did you mean"),
        ({"method": "dare_ties", "params": {"density": 0.7}}, "drop_rate = 1 - density", "did you mean"),
        ({"method": "ties", "params": {"int8_mask": True}}, "only changes the dtype", "did you mean"),
        ({"method": "ties", "params": {"weight": 0.5}}, "experts: [{path: ..., weight: 0.6}]", "did you mean"),
        ({"method": "task_adapter"}, "mergekit method that specmerge does not implement", "did you mean"),
        ({"method": "karcher_mean"}, "did you mean 'karcher'", "mergekit method"),
        ({"method": "ties", "models": ["a"]}, "'models' is mergekit's list of inputs", "'modules'?"),
        ({"method": "ties", "merge_method": "ties"}, "a specmerge recipe says 'method'", "did you mean"),
    ],
)
def test_mergekit_names_are_explained_not_guessed(data, says, not_says):
    message = refused(data)
    assert says in message and not_says not in message


def test_a_typo_still_gets_the_closest_name():
    assert "did you mean 'density'?" in refused({"method": "ties", "params": {"densty": 0.3}})
    with pytest.raises(ValueError, match="did you mean 'slerp'"):
        get_method("slerpp")
