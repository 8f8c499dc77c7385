"""`hf-scale search`: run the search recipe that ships beside the package in the repository."""

from __future__ import annotations

from hf_scale.recipe_runner import run_recipe


def run_search_recipe(argv: list[str]) -> None:
    """Run recipes/search_llama2.py with `argv` in this process (so `accelerate launch -m hf_scale.cli` works)."""
    run_recipe("search_llama2.py", argv)
