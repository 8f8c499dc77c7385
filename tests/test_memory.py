import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from hf_scale.errors import ConfigError
from hf_scale.hardware import get_gpu
from hf_scale.memory import ModelShape, Workload, estimate, plan, quantized_base_bytes
from hf_scale.model_shapes import model_shape

LLAMA2 = ["meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf"]


@pytest.fixture(scope="module")
def shapes():
    return {name: model_shape(name) for name in LLAMA2}


def test_llama2_parameter_counts_offline(shapes):
    counts = [shapes[name].parameters for name in LLAMA2]
    assert counts == [6_738_415_616, 13_015_864_320, 68_976_648_192]


def test_zero_paper_worked_example():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)
    shape = ModelShape("paper", 7_500_000_000, 1, 1, 1, 1, 1, 1)
    workload = Workload(gpu=get_gpu("a100-80g"), gpus_per_node=8, nodes=8)
    states = {
        s: estimate(shape, workload, s, accounting="paper").model_states / 1e9
        for s in ("ddp", "zero1", "zero2", "zero3")
    }
    assert states["ddp"] == pytest.approx(120, abs=0.05)
    assert states["zero1"] == pytest.approx(31.4, abs=0.05)
    assert states["zero2"] == pytest.approx(16.6, abs=0.05)
    assert states["zero3"] == pytest.approx(1.9, abs=0.05)


@pytest.mark.parametrize("name", LLAMA2)
@pytest.mark.parametrize("gpus_per_node, nodes", [(4, 1), (8, 1), (8, 2)])
def test_agrees_with_deepspeeds_estimators(shapes, name, gpus_per_node, nodes):
    shape = shapes[name]
    workload = Workload(gpu=get_gpu("a100-80g"), gpus_per_node=gpus_per_node, nodes=nodes)
    p, layer = shape.parameters, shape.largest_layer_parameters

    def ours(strategy):
        return estimate(shape, workload, strategy)

    _, gpu = estimate_zero2_model_states_mem_needs(p, gpus_per_node, nodes, cpu_offload=False)
    assert ours("zero2").model_states == pytest.approx(gpu, rel=0.01)
    cpu, gpu = estimate_zero2_model_states_mem_needs(p, gpus_per_node, nodes, cpu_offload=True)
    assert ours("zero2_offload").model_states == pytest.approx(gpu, rel=0.01)
    assert ours("zero2_offload").cpu_per_node == pytest.approx(cpu / nodes, rel=0.01)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(p, layer, gpus_per_node, nodes, cpu_offload=False)
    # the engine holds a 16-bit gradient partition beside the fp32 one; the stage-3 estimator counts only one
    bf16_gradient_partition = 2 * p / workload.gpus
    assert ours("zero3").model_states - bf16_gradient_partition == pytest.approx(gpu, rel=0.01)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, layer, gpus_per_node, nodes)
    assert ours("zero3_offload").model_states == pytest.approx(gpu, rel=0.01)
    assert ours("zero3_offload").cpu_per_node == pytest.approx(cpu, rel=0.01)


def test_seven_b_on_four_a100s_fits_sharded_not_replicated(shapes):
    result = plan(shapes[LLAMA2[0]], Workload(gpu=get_gpu("a100-80g"), gpus_per_node=4, seq_len=512, micro_batch=2))
    assert not result.estimates["ddp"].fits  # 16 bytes per parameter: 108 GB
    assert result.recommendation in ("zero1", "zero2")
    assert result.estimates["zero2"].total < 80e9


def test_nothing_fits_gives_advice_not_a_stack_trace(shapes):
    result = plan(shapes[LLAMA2[2]], Workload(gpu=get_gpu("rtx4090-24g"), gpus_per_node=1, seq_len=4096, micro_batch=4))
    assert result.recommendation is None
    assert result.advice and any("GPUs" in line or "LoRA" in line for line in result.advice)


def test_communication_bound_on_pcie_cards(shapes):
    seven_b = shapes[LLAMA2[0]]
    a100 = plan(seven_b, Workload(gpu=get_gpu("a100-80g"), gpus_per_node=4, seq_len=2048, micro_batch=4))
    rtx = plan(seven_b, Workload(gpu=get_gpu("rtx4090-24g"), gpus_per_node=4, seq_len=512, micro_batch=1))
    # ZeRO-3 moves about 3x the 16-bit parameters per step: NVLink hides it behind compute, PCIe does not
    assert rtx.estimates["zero3"].communication_seconds > 5 * a100.estimates["zero3"].communication_seconds
    assert rtx.estimates["zero3"].communication_bound and not a100.estimates["zero3"].communication_bound


def test_unknown_gpu_lists_the_catalogue():
    with pytest.raises(ConfigError, match=r"unknown GPU 'v100'; known GPUs: a100-40g, a100-80g, rtx4090-24g"):
        get_gpu("v100")


def test_a_local_config_is_counted_on_the_meta_device(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = model_shape(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.parameters == sum({id(p): p.numel() for p in model.parameters()}.values())
    assert shape.layers == 3 and isinstance(shape.parameters, int)


def stored_bytes(model) -> int:
    """What the model's tensors hold, bitsandbytes' quantization constants included (each tensor counted once)."""
    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    def add_state(state):
        add(state.absmax)
        add(state.code)
        if state.nested:
            add(state.offset)
            add_state(state.state2)

    for parameter in model.parameters():
        add(parameter.data)
        if getattr(parameter, "quant_state", None) is not None:
            add_state(parameter.quant_state)
        if getattr(parameter, "SCB", None) is not None:  # int8: a scale per row
            add(parameter.SCB)
    return total


@pytest.mark.parametrize("quantization, double", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_qlora_row_matches_what_bitsandbytes_stores_for_the_tiny_model(tiny_model_dir, quantization, double):
    """The tiny LLaMA loaded as a QLoRA run loads it (projections quantized, the rest fp32, adapters fp32)."""
    from transformers import AutoConfig

    from hf_scale.modeling import ModelArguments, load_model, load_tokenizer

    args = ModelArguments(lora_r=8, quantization=quantization, double_quantization=double)
    model = load_model(args, str(tiny_model_dir), load_tokenizer(str(tiny_model_dir)))
    shape = model_shape(AutoConfig.from_pretrained(tiny_model_dir))
    trainable = shape.lora_parameters(8, Workload(gpu=get_gpu("rtx4090-24g")).lora_targets)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    planned = quantized_base_bytes(shape, quantization, double) + 4 * trainable
    assert planned == pytest.approx(stored_bytes(model), rel=0.02)


@pytest.mark.parametrize("quantization, double", [("nf4", True), ("int8", False)])
def test_qlora_row_matches_bitsandbytes_for_llama2_7b(quantization, double):
    """LLaMA-2-7B's shape: each distinct projection quantized once by bitsandbytes (random weights of its size),
    the rest counted on the meta device."""
    import bitsandbytes as bnb
    import torch

    from hf_scale.model_shapes import KNOWN_CONFIGS, count_parameters

    shape = model_shape("meta-llama/Llama-2-7b-hf")
    assert count_parameters(KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]) == shape.parameters
    quantized, linear_weights = 0, 0
    for in_features, out_features in set(shape.projections.values()):
        layers = shape.layers * list(shape.projections.values()).count((in_features, out_features))
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        if quantization == "int8":
            layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, quant_type=quantization)
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, compress_statistics=double, quant_type=quantization
            )
        quantized += layers * stored_bytes(layer.to("cpu"))  # bitsandbytes quantizes as the layer is placed
        linear_weights += layers * in_features * out_features
    measured = quantized + 4 * (shape.parameters - linear_weights)
    assert quantized_base_bytes(shape, quantization, double) == pytest.approx(measured, rel=0.02)
