#!/usr/bin/env python
"""Launches the fine-tuning recipe, which ships in the package: read it in hf_scale/recipes/finetune_llama2.py.

    accelerate launch recipes/finetune_llama2.py --config llama2_7b_4xa100_zero1

is `hf-scale train --config llama2_7b_4xa100_zero1` on every process; `hf-scale recipes copy finetune FILE` copies
the recipe out to edit.
"""

from hf_scale.recipes.finetune_llama2 import main
from hf_scale.recipes.preparation import run_as_program

if __name__ == "__main__":
    run_as_program(main)
