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


def planned(tmp_path, model_args=None, **kwargs) -> ScaleTrainingArguments:
    args = ScaleTrainingArguments(output_dir=str(tmp_path), zero_preset="auto", plan_seq_len=512, **kwargs)
    return prepare_run(args, model_args)


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


ONE_4090 = dict(plan_gpu="rtx4090-24g", gradient_checkpointing=True)


def test_auto_trains_adapters_with_plain_ddp_when_they_fit(tmp_path):
    """With the recipe's model arguments the planner sizes what is trained: LoRA on 7B and QLoRA on 13B fit one 4090
    with a whole base per GPU (plain DDP), where full fine-tuning of 7B needs the optimizer in host memory."""
    from hf_scale.modeling import ModelArguments

    seven_b = dict(plan_model="meta-llama/Llama-2-7b-hf", per_device_train_batch_size=4, **ONE_4090)
    assert planned(tmp_path, **seven_b).zero_preset == "zero2_offload"
    assert planned(tmp_path, ModelArguments(lora_r=16), **seven_b).zero_preset == "ddp"
    thirteen_b = dict(plan_model="meta-llama/Llama-2-13b-hf", per_device_train_batch_size=2, **ONE_4090)
    qlora = ModelArguments(lora_r=16, quantization="nf4")
    args = planned(tmp_path, qlora, **thirteen_b)
    assert args.zero_preset == "ddp" and not args.deepspeed
    # LoRA on 13B does not fit one 4090 with a 16-bit base: the base is sharded as full fine-tuning's would be
    assert planned(tmp_path, ModelArguments(lora_r=16), **thirteen_b).zero_preset == "zero3_offload"


def test_auto_refuses_qlora_that_does_not_fit_with_the_planned_figure(tmp_path):
    from hf_scale.modeling import ModelArguments

    seventy_b = dict(plan_model="meta-llama/Llama-2-70b-hf", per_device_train_batch_size=1, **ONE_4090)
    with pytest.raises(ConfigError, match=r"QLoRA \(nf4, r=16\) of meta-llama/Llama-2-70b-hf needs 40.8 GiB per GPU"):
        planned(tmp_path, ModelArguments(lora_r=16, quantization="nf4"), **seventy_b)
