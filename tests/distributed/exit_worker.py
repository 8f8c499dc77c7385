"""Ends like `Trainer.train()` ends: an all_gather into tensors that Python drops at once, then the process exits.

Launched by test_exit.py with torchrun; not a test itself. Usage: [--release-gil-at-exit]
"""

import sys

import torch
import torch.distributed as dist

from hf_scale.distributed import release_gil_to_collectives_at_exit

dist.init_process_group("gloo")
if "--release-gil-at-exit" in sys.argv:
    release_gil_to_collectives_at_exit()  # what ScaleTrainer does when it is built
# transformers' store_flos (trainer_pt_utils.distributed_broadcast_scalars): the gathered list is dropped on return.
gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.ones(1))
assert torch.cat(gathered).sum().item() == dist.get_world_size()
del gathered
