import pytest
from torch import nn

from hf_scale.distributed import check_elastic_restarts, check_model_is_wrapped, check_process_group
from hf_scale.errors import DistributedSetupError


def test_independent_copies_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedSetupError, match=r"started 2 processes .* sees world size 1.*use_cpu=True"):
        check_process_group(world_size=1, distributed_type="NO")


def test_process_group_without_ddp_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedSetupError, match="distributed mode is NO"):
        check_process_group(world_size=2, distributed_type="NO")


def test_real_distributed_runs_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_process_group(world_size=2, distributed_type="MULTI_CPU")
    check_process_group(world_size=2, distributed_type="DEEPSPEED")
    monkeypatch.delenv("WORLD_SIZE")
    check_process_group(world_size=1, distributed_type="NO")


def test_plain_model_in_a_multi_process_run_is_refused():
    model = nn.Linear(2, 2)
    check_model_is_wrapped(model, world_size=1)
    with pytest.raises(DistributedSetupError, match="plain Linear, not wrapped"):
        check_model_is_wrapped(model, world_size=2)


def test_restarts_that_would_hang_are_refused_before_the_process_group_starts(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun --master_port, or c10d's shared store
    with pytest.raises(DistributedSetupError, match=r"--max_restarts 3 .*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_elastic_restarts()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d with a store per attempt: restarts work
    check_elastic_restarts()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restart, nothing to hang
    check_elastic_restarts()
