"""`hf-scale search`: run the search recipe that ships beside the package in the repository."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from hf_scale.errors import HfScaleError

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "search_llama2.py"


def run_search_recipe(argv: list[str]) -> None:
    """Run recipes/search_llama2.py with `argv` in this process (so `accelerate launch -m hf_scale.cli` works)."""
    if not RECIPE.is_file():
        raise HfScaleError(f"the search recipe is not at {RECIPE}: run it from a clone of the repository")
    saved = sys.argv
    sys.argv = [str(RECIPE), *argv]
    try:
        runpy.run_path(str(RECIPE), run_name="__main__")
    finally:
        sys.argv = saved
