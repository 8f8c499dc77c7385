#!/usr/bin/env python
"""Launches the search recipe, which ships in the package: read it in hf_scale/recipes/search_llama2.py.

    torchrun --nproc_per_node 2 recipes/search_llama2.py --config search_tiny_cpu

is `hf-scale search --config search_tiny_cpu` on every process; `hf-scale recipes copy search FILE` copies the
recipe out to edit.
"""

from hf_scale.recipes.preparation import run_as_program
from hf_scale.recipes.search_llama2 import main

if __name__ == "__main__":
    run_as_program(main)
