import pytest

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.errors import ConfigError
from hf_scale.hardware import gpu_from_device_name


@pytest.mark.parametrize(
    "device_name, catalogue_name",
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA A100-PCIE-40GB", "a100-40g"),
        ("NVIDIA GeForce RTX 4090", "rtx4090-24g"),
        ("NVIDIA H100 80GB HBM3", "h100-80g"),
        ("NVIDIA H200", "h200-141g"),
        ("NVIDIA L40S", "l40s-48g"),
    ],
)
def test_cuda_device_names_map_to_the_catalogue(device_name, catalogue_name):
    assert gpu_from_device_name(device_name).name == catalogue_name


def test_unknown_card_is_not_guessed():
    assert gpu_from_device_name("NVIDIA Tesla T4") is None
    assert gpu_from_device_name("NVIDIA L40") is None  # not an L40S
    assert gpu_from_device_name("Tesla V100-SXM2-32GB") is None


def planned(tmp_path, **kwargs) -> ScaleTrainingArguments:
    return prepare_run(ScaleTrainingArguments(output_dir=str(tmp_path), zero_preset="auto", plan_seq_len=512, **kwargs))


def test_auto_takes_the_planners_pick(tmp_path):
    # one 4090: 7B full fine-tuning fits only with the optimizer in host memory
    args = planned(
        tmp_path,
        plan_model="meta-llama/Llama-2-7b-hf",
        plan_gpu="rtx4090-24g",
        per_device_train_batch_size=1,
        gradient_checkpointing=True,
    )
    assert args.zero_preset == "zero2_offload"
    assert args.deepspeed["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_auto_without_deepspeed_when_plain_ddp_fits(tmp_path, tiny_model_dir):
    args = planned(tmp_path, plan_model=str(tiny_model_dir), plan_gpu="a100-80g")
    assert args.zero_preset == "ddp" and not args.deepspeed


def test_auto_gives_the_planners_advice_when_nothing_fits(tmp_path):
    with pytest.raises(ConfigError, match="70b-hf fits no strategy on 1 rtx4090-24g: gradient checkpointing makes a"):
        planned(tmp_path, plan_model="meta-llama/Llama-2-70b-hf", plan_gpu="rtx4090-24g")


def test_auto_needs_a_model_and_a_known_gpu(tmp_path):
    with pytest.raises(ConfigError, match="zero_preset=auto: set plan_model"):
        planned(tmp_path, plan_gpu="a100-80g")
    with pytest.raises(ConfigError, match="gpu: unknown GPU 'v100'; known GPUs: a100-40g"):
        planned(tmp_path, plan_model="meta-llama/Llama-2-7b-hf", plan_gpu="v100")
