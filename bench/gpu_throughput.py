"""Training throughput on one GPU: plain Trainer vs ScaleTrainer, dynamic padding vs packing, checkpointing.

    python bench/gpu_throughput.py                        # ~1B LLaMA, bf16 autocast, sdpa, on the GPU it finds
    python bench/gpu_throughput.py --size 3b --steps 40
    python bench/gpu_throughput.py --size tiny            # CPU, seconds (the test suite runs this)

One process measures, one after the other, on the same data in the same order, each for --steps steps after
--warmup-steps steps:
  (a) transformers.Trainer, dynamic padding     (b) ScaleTrainer, the same settings
  (c) ScaleTrainer, packing                     (d) (c) plus gradient checkpointing
and reports for each: real (non-pad) tokens/s, achieved model TFLOP/s (hf_scale.flops: 6 x matmul weights +
full-square attention over each example's own length; checkpointing's recomputation is not counted), MFU
against the peak it measures with a large matrix product on the same device (bf16 on GPU, fp32 on CPU),
peak memory (CUDA max allocated; not measured on CPU) and the memory planner's prediction for that
configuration: hf_scale.memory.estimate(strategy="ddp"), i.e. fp32 weights and Adam states under bf16
autocast, which is what bf16=True trains with, for the largest micro-batch the run saw (rows x padded width
for padded batches, 1 x row length for packed ones: activations grow with the tokens of a micro-batch).

Data: the real Alpaca set (--data, default ../shared/data/alpaca_en_demo.json), tokenized with the project's
byte-level BPE trained on it; generated records of Alpaca's lengths when the file is absent. The model is
randomly initialised at a fixed seed; its vocabulary is LLaMA-2's 32000 (the tokenizer uses the first rows).
Tokens are counted by a forward pre-hook on the model, the same for every trainer, without a host sync; time
is taken between two synchronised step ends. It writes the table as JSON (--output) and prints it last.

Reading (c): transformers runs sdpa on a packed row with an explicit block-diagonal mask, so the kernel computes
attention over the whole row's square, masked; model FLOPs count each example's own square only, so that
extra work shows as lower MFU (1b, 16 Alpaca examples a row, ~3200 tokens: 22 % more FLOPs than counted).
"""

import argparse
import gc
import json
import math
import platform
import random
import statistics
import string
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.callbacks.throughput import batch_counts
from hf_scale.data.batching import make_collator
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import tokenize_records
from hf_scale.flops import effective_seq_len, mfu, training_flops_per_token
from hf_scale.hardware import CATALOGUE, GIB, gpu_from_device_name
from hf_scale.memory import Workload, estimate
from hf_scale.model_shapes import shape_from_config
from hf_scale.tiny.build import build_tiny_tokenizer
from hf_scale.trainer import ScaleTrainer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "alpaca_en_demo.json"
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "gpu_throughput.json"
MODEL_SEED = 0
LLAMA_VOCAB = 32000

# LLaMA-2 shapes, untied LM head, vocabulary 32000. 1b (1.06B parameters): head width 128 and MLP width
# 8/3 x hidden rounded up to 256, as LLaMA-2; 3b (3.43B) is OpenLLaMA-3B's shape; 7b is LLaMA-2 7B (6.74B).
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16),
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
}
MODES = {
    # name: (trainer class, packing, gradient checkpointing)
    "a_trainer_padded": (Trainer, False, False),
    "b_scale_padded": (ScaleTrainer, False, False),
    "c_scale_packed": (ScaleTrainer, True, False),
    "d_scale_packed_checkpointing": (ScaleTrainer, True, True),
}
TARGETS = {"b_over_a": 0.98, "c_over_a": 1.5, "mfu_c": 0.5, "planner_error": 0.10}


def generated_records(count: int = 1000, seed: int = 0) -> list[dict[str, str]]:
    """Alpaca-shaped records of generated words with about Alpaca's lengths, for machines without the real set.

    Measured with the bench's 32k tokenizer and the Alpaca prompt: median 173 tokens and 54 % of a padded
    batch of 16 is padding; alpaca_en_demo.json: 162 tokens, 55 %. The padding share is what packing saves."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(4000)]
    records = []
    for _ in range(count):
        output_words = min(int(rng.lognormvariate(math.log(40), 1.3)), 450)
        input_words = rng.choice([0, 0, rng.randint(3, 40)])  # about a third of Alpaca records have an input
        records.append(
            {
                "instruction": " ".join(rng.choices(words, k=rng.randint(4, 20))).capitalize() + ".",
                "input": " ".join(rng.choices(words, k=input_words)),
                "output": " ".join(rng.choices(words, k=output_words)),
            }
        )
    return records


def load_data(path: Path, size: str, max_length: int):
    """(tokenizer, tokenized dataset, description) for the Alpaca file at `path`, or generated records."""
    if path.is_file():
        records, source = json.loads(path.read_text()), str(path)
    else:
        records, source = generated_records(), f"generated (no file at {path})"
    template = get_template("alpaca_zh" if "zh" in path.name else "alpaca")
    texts = [r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in records]
    tokenizer = build_tiny_tokenizer(vocab_size=1024 if size == "tiny" else LLAMA_VOCAB, texts=texts)
    tokenizer.pad_token = tokenizer.unk_token
    dataset, summary = tokenize_records(records, tokenizer, template, max_length=max_length)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    described = {
        "source": source,
        "records": len(records),
        "examples": summary.examples,
        "median_tokens": statistics.median(lengths),
        "max_length": max_length,
        "response_cut": summary.response_cut,
        "tokenizer_vocab": len(tokenizer),
    }
    return tokenizer, dataset, described


def model_config(size: str, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        **SIZES[size],
        vocab_size=len(tokenizer) if size == "tiny" else max(LLAMA_VOCAB, len(tokenizer)),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        use_cache=False,  # training only; packed batches need it off (ScaleTrainer passes it for them anyway)
        attn_implementation="sdpa",
    )


def measure_peak_flops(device: torch.device) -> tuple[float, str]:
    """FLOP/s of a large matrix product on `device`: bf16 8192^3 on GPU, fp32 1024^3 on CPU."""
    cuda = device.type == "cuda"
    n, dtype, repeats = (8192, torch.bfloat16, 50) if cuda else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    seconds = time.perf_counter() - start
    return 2 * n**3 * repeats / seconds, f"{str(dtype).removeprefix('torch.')} {n}x{n}x{n}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(TrainerCallback):
    """Time and micro-batch count at the end of the warm-up's last step and of the last measured step."""

    def __init__(self, marks_at: tuple[int, int], batches: list, device: torch.device) -> None:
        self.marks_at, self.batches, self.device = marks_at, batches, device
        self.marks: dict[int, tuple[float, int]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.marks_at:
            synchronize(self.device)
            self.marks[state.global_step] = (time.perf_counter(), len(self.batches))


def count_batches(model: torch.nn.Module, batches: list):
    """Record (counts tensor, input shape) of each training forward: the same hook for every trainer."""

    def hook(module, args, kwargs):
        if module.training:
            batches.append((batch_counts(kwargs), tuple(kwargs["input_ids"].shape)))

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def run_mode(name: str, config: LlamaConfig, tokenizer, dataset, options, device: torch.device) -> dict:
    trainer_class, packing, checkpointing = MODES[name]
    args_class = ScaleTrainingArguments if trainer_class is ScaleTrainer else TrainingArguments
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # Anything a previous mode left allocated would count in this one's peak: recorded, and taken off.
    leftover = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(MODEL_SEED)
    with device:  # initialised where it trains: seconds for 1B on a GPU instead of a minute on the CPU
        model = LlamaForCausalLM(config)
    batches: list = []
    hook = count_batches(model, batches)
    first, last = options.warmup_steps, options.warmup_steps + options.steps
    clock = StepClock((first, last), batches, device)
    with tempfile.TemporaryDirectory() as output_dir:
        args = args_class(
            output_dir=output_dir,
            max_steps=last,
            per_device_train_batch_size=options.batch_size,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            bf16=cuda,
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=not cuda,
            dataloader_pin_memory=cuda,
            seed=0,
        )
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=make_collator(tokenizer, packing=packing),
            callbacks=[clock],
        )
        trainer.train()
    hook.remove()
    peak_bytes = torch.cuda.max_memory_allocated(device) - leftover if cuda else None
    (start, start_index), (end, end_index) = clock.marks[first], clock.marks[last]
    measured = batches[start_index:end_index]
    tokens, samples, squared = torch.stack([counts for counts, _ in measured]).sum(0).tolist()
    batch_tokens = sum(math.prod(shape) for _, shape in measured)
    rows, width = max((shape for _, shape in batches), key=math.prod)  # the largest micro-batch of the run
    seconds = end - start
    flops_per_token = training_flops_per_token(config, effective_seq_len(tokens, squared))
    planner = estimate(
        shape_from_config(name, config),
        Workload(gpu=options.gpu, seq_len=width, micro_batch=rows, gradient_checkpointing=checkpointing),
        "ddp",
    )
    model_ref = weakref.ref(model)
    del trainer, model, batches, measured
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "mode": name,
        "trainer": trainer_class.__name__,
        "packing": packing,
        "gradient_checkpointing": checkpointing,
        "steps": options.steps,
        "seconds": seconds,
        "real_tokens": tokens,
        "real_tokens_per_second": tokens / seconds,
        "batch_tokens_per_second": batch_tokens / seconds,  # padding included
        "samples_per_second": samples / seconds,
        "flops_per_token": flops_per_token,
        "tflops": tokens * flops_per_token / seconds / 1e12,
        "mfu": mfu(tokens / seconds, flops_per_token, options.peak_flops),
        "mfu_datasheet": mfu(tokens / seconds, flops_per_token, options.datasheet_flops)
        if options.datasheet_flops
        else None,
        "peak_memory_gib": peak_bytes / GIB if peak_bytes is not None else None,
        "leftover_at_start_gib": leftover / GIB if cuda else None,
        "model_freed": model_ref() is None,  # False: something still holds this mode's model (a leak)
        "largest_micro_batch": [rows, width],
        "planner_peak_gib": planner.total / GIB,
        # what max_memory_allocated can see: the planner's total less its CUDA-context/NCCL allowance
        "planner_allocated_gib": (planner.total - planner.overhead) / GIB,
        "planner_error": planner.total / peak_bytes - 1 if peak_bytes else None,
        "planner_allocated_error": (planner.total - planner.overhead) / peak_bytes - 1 if peak_bytes else None,
    }


def ratios_and_criteria(rows: dict[str, dict], device_name: str) -> tuple[dict, dict]:
    def tokens(mode: str) -> float | None:
        row = rows.get(mode, {})
        return row.get("real_tokens_per_second")

    def ratio(top: str, bottom: str) -> float | None:
        return tokens(top) / tokens(bottom) if tokens(top) and tokens(bottom) else None

    ratios = {
        "b_over_a": ratio("b_scale_padded", "a_trainer_padded"),
        "c_over_a": ratio("c_scale_packed", "a_trainer_padded"),
        "d_over_c": ratio("d_scale_packed_checkpointing", "c_scale_packed"),
    }
    hopper = gpu_from_device_name(device_name) in (CATALOGUE["h100-80g"], CATALOGUE["h200-141g"])
    mfu_c = rows.get("c_scale_packed", {}).get("mfu")
    errors = [rows.get(mode, {}).get("planner_error") for mode in ("a_trainer_padded", "c_scale_packed")]
    errors.append(rows.get("d_scale_packed_checkpointing", {}).get("planner_error"))
    criteria = {
        "b_over_a >= 0.98": ratios["b_over_a"] >= TARGETS["b_over_a"] if ratios["b_over_a"] else None,
        "c_over_a >= 1.5": ratios["c_over_a"] >= TARGETS["c_over_a"] if ratios["c_over_a"] else None,
        "mfu_c >= 0.5 (H100/H200)": mfu_c >= TARGETS["mfu_c"] if hopper and mfu_c is not None else None,
        "planner within 10 % (a, c, d)": all(abs(e) <= TARGETS["planner_error"] for e in errors)
        if None not in errors
        else None,
    }
    return ratios, criteria


def table(rows: dict[str, dict]) -> str:
    def cell(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, int | float) else "-"

    lines = [
        f"{'mode':<30}{'real tok/s':>12}{'batch tok/s':>12}{'TFLOP/s':>9}{'MFU':>7}"
        f"{'peak GiB':>10}{'planner GiB':>12}{'error':>8}  largest micro-batch"
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"{name:<30}failed: {row['error']}")
            continue
        lines.append(
            f"{name:<30}{cell(row['real_tokens_per_second'], ',.0f'):>12}"
            f"{cell(row['batch_tokens_per_second'], ',.0f'):>12}"
            f"{cell(row['tflops'], '.3g'):>9}{cell(row['mfu'], '.1%'):>7}{cell(row['peak_memory_gib'], '.2f'):>10}"
            f"{cell(row['planner_peak_gib'], '.2f'):>12}{cell(row['planner_error'], '+.1%'):>8}"
            f"  {row['largest_micro_batch'][0]} x {row['largest_micro_batch'][1]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="1b")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps per mode before measuring (>= 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per micro-batch")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="an Alpaca-format JSON file")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    options = parser.parse_args(argv)
    if options.warmup_steps < 1 or options.steps < 1:
        parser.error("--steps and --warmup-steps must be at least 1")

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    catalogue_gpu = gpu_from_device_name(device_name) if device.type == "cuda" else None
    # The planner's total does not depend on the GPU (only whether it fits does): any entry serves on CPU.
    options.gpu = catalogue_gpu or CATALOGUE["h100-80g"]
    options.datasheet_flops = catalogue_gpu.bf16_tflops * 1e12 if catalogue_gpu else None
    options.peak_flops, peak_kind = measure_peak_flops(device)
    print(f"{device_name}: measured peak {options.peak_flops / 1e12:.1f} TFLOP/s ({peak_kind})", flush=True)

    started = time.perf_counter()
    tokenizer, dataset, data = load_data(options.data, options.size, options.max_length)
    dataset = dataset.shuffle(seed=0)
    config = model_config(options.size, tokenizer)
    parameters = shape_from_config(options.size, config).parameters
    print(
        f"data: {data['source']}, {data['examples']} examples, median {data['median_tokens']} tokens "
        f"({time.perf_counter() - started:.0f} s); model: {options.size}, {parameters / 1e9:.3f}B parameters",
        flush=True,
    )

    rows: dict[str, dict] = {}
    for name in options.modes:
        started = time.perf_counter()
        try:
            rows[name] = run_mode(name, config, tokenizer, dataset, options, device)
        except Exception as error:  # one failed mode (out of memory, say) must not lose the others
            traceback.print_exc()
            rows[name] = {"mode": name, "error": f"{type(error).__name__}: {error}"}
        # after the except block: until then the traceback's frames hold the failed mode's model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: done in {time.perf_counter() - started:.0f} s", flush=True)

    ratios, criteria = ratios_and_criteria(rows, device_name)
    result = {
        "device": device_name,
        "catalogue_gpu": catalogue_gpu.name if catalogue_gpu else None,
        "peak_tflops_measured": options.peak_flops / 1e12,
        "peak_kind": peak_kind,
        "peak_tflops_datasheet": options.datasheet_flops / 1e12 if options.datasheet_flops else None,
        "size": options.size,
        "parameters": parameters,
        "model": {key: getattr(config, key) for key in (*SIZES["tiny"], "vocab_size")},
        "precision": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32",
        "attention": config._attn_implementation,
        "batch_size": options.batch_size,
        "steps": options.steps,
        "warmup_steps": options.warmup_steps,
        "data": data,
        "planner": "hf_scale.memory.estimate(strategy='ddp') for the largest micro-batch of each mode",
        "rows": rows,
        "ratios": ratios,
        "criteria": criteria,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        },
        "deepspeed_imported": sys.modules.get("deepspeed") is not None,
    }
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(result, indent=2) + "\n")
    print("ratios: " + ", ".join(f"{k} = {v:.3f}" if v else f"{k} = -" for k, v in ratios.items()))
    print("criteria: " + ", ".join(f"{k}: {v}" for k, v in criteria.items()))
    print(f"wrote {options.output}\n")
    print(table(rows), flush=True)
    return result


if __name__ == "__main__":
    main()
