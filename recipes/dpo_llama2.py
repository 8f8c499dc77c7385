#!/usr/bin/env python
"""Launches the preference-tuning recipe, which ships in the package: read it in hf_scale/recipes/dpo_llama2.py.

    accelerate launch recipes/dpo_llama2.py --config llama2_7b_4xa100_zero3_dpo

is `hf-scale dpo --config llama2_7b_4xa100_zero3_dpo` on every process; `hf-scale recipes copy dpo FILE` copies the
recipe out to edit.
"""

from hf_scale.recipes.dpo_llama2 import main
from hf_scale.recipes.preparation import run_as_program

if __name__ == "__main__":
    run_as_program(main)
