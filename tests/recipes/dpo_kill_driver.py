"""Runs `hf-scale dpo` (the recipe's main, with the flags given) and SIGKILLs the process at the end of optimizer step
KILL_AT_STEP, after the checkpoint of the step before it is complete: a node lost mid-run, at a known step. Launched
by tests/recipes/test_dpo_llama2.py (under torchrun; rank 0 kills itself and torchrun ends the other); not a test.

    python tests/recipes/dpo_kill_driver.py KILL_AT_STEP --config ... (the recipe's flags)
"""

import os
import signal
import sys

from transformers import TrainerCallback

from hf_scale.recipes import dpo_llama2
from hf_scale.recipes.preparation import run_as_program


class KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and state.is_world_process_zero:
            os.kill(os.getpid(), signal.SIGKILL)


class KilledPreferenceTrainer(dpo_llama2.PreferenceTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(KillAt(KILL_AT_STEP))


if __name__ == "__main__":
    KILL_AT_STEP = int(sys.argv.pop(1))
    dpo_llama2.PreferenceTrainer = KilledPreferenceTrainer
    run_as_program(dpo_llama2.main)
