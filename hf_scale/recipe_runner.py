"""Run a recipe from `recipes/` in this process, as `hf-scale train` and `hf-scale search` do."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from hf_scale.errors import HfScaleError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def run_recipe(filename: str, argv: list[str]) -> None:
    """Run recipes/<filename> with `argv` as its command line, as if it were the script launched.

    In this process, so that `accelerate launch -m hf_scale.cli train ...` and `torchrun -m hf_scale.cli ...`
    start the recipe on every rank.
    """
    recipe = RECIPES / filename
    if not recipe.is_file():
        raise HfScaleError(f"the recipe is not at {recipe}: run hf-scale from a clone of the repository")
    saved = sys.argv
    sys.argv = [str(recipe), *argv]
    try:
        runpy.run_path(str(recipe), run_name="__main__")
    finally:
        sys.argv = saved
