"""The `hf-scale` command: `plan` (memory per strategy and a recommendation), `presets` (list, show), `train` (the
fine-tuning recipe), `dpo` (preference tuning after it), `search` (the hyperparameter search recipe), `recipes` (the
shipped configs; copy a recipe out), `report` (a search's trials table and plots), `env` (versions, devices,
DeepSpeed ops), `chat` (talk to a trained run) and `export` (a plain HF folder from a run, LoRA merged)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import sys
from pathlib import Path

from hf_scale.errors import HfScaleError

# Every `hf-scale ...` line of these examples runs in tests/test_cli.py (report on a study it builds).
MAIN_EXAMPLES = """examples:
  hf-scale plan --model meta-llama/Llama-2-7b-hf --gpu a100-80g --gpus 4 --micro-batch 2
  hf-scale presets show zero2
  hf-scale train --max_steps 100                   # the embedded tiny default, on any CPU
  hf-scale env
"""

PLAN_EXAMPLES = """examples:
  hf-scale plan --model meta-llama/Llama-2-7b-hf --gpu a100-80g --gpus 4
  hf-scale plan --model meta-llama/Llama-2-70b-hf --gpu a100-80g --gpus 8 --nodes 2 --seq-len 2048 --grad-ckpt
  hf-scale plan --model meta-llama/Llama-2-13b-hf --gpu rtx4090-24g --gpus 4 --micro-batch 1 --lora-r 16 --json
  hf-scale plan --model meta-llama/Llama-2-70b-hf --gpu rtx4090-24g --lora-r 16 --quantization nf4 --grad-ckpt
  hf-scale plan --model packaged:SmolLM2-135M-Instruct --gpu rtx4090-24g --seq-len 256 --micro-batch 4
  (--model also takes a hub id, a local folder with a config.json, or a .gguf file)
"""

PRESETS_EXAMPLES = """examples:
  hf-scale presets list
  hf-scale presets show zero3_offload
"""

ENV_EXAMPLES = """examples:
  hf-scale env
  hf-scale env --json
"""

REPORT_EXAMPLES = """examples:
  hf-scale report outputs/search-tiny-cpu/optuna_study.db
  hf-scale report outputs/search-tiny-cpu/optuna_study.db --out outputs/search-tiny-cpu/hpo-report
  (a study's storage URL works too: postgresql://USER:PASSWORD@HOST/DB)
"""


TRAIN_EXAMPLES = """examples:
  hf-scale train --max_steps 100                   # the embedded tiny default, on any CPU
  on GPU nodes, on every process (see README.md "On a GPU node"):
  accelerate launch --config_file 1node_4gpu.yaml -m hf_scale.cli train --config llama2_7b_4xa100_zero1
"""

DPO_EXAMPLES = """examples:
  hf-scale dpo --max_steps 20                      # the embedded tiny default (after hf-scale train), on any CPU
  hf-scale dpo --loss_type simpo --beta 2.0 --max_steps 20
  on GPU nodes, on every process (see README.md "Preference tuning after SFT"):
  accelerate launch --config_file 1node_4gpu.yaml -m hf_scale.cli dpo --config llama2_7b_4xa100_zero3_dpo
"""

SEARCH_EXAMPLES = """examples:
  hf-scale search --n_trials 2 --max_steps 20      # the embedded tiny default, on any CPU
  on GPU nodes, on every process (see README.md "Hyperparameter search"):
  accelerate launch --config_file 1node_4gpu.yaml -m hf_scale.cli search --config search_llama2_7b_lora
  4 trials at once, one per GPU, started as one process (see README.md "Hyperparameter search"):
  hf-scale search --config search_llama2_7b_lora --parallel_trials 4 --pruner asha
"""

RECIPES_EXAMPLES = """examples:
  hf-scale recipes list
  hf-scale recipes copy finetune my_finetune.py    # then: accelerate launch my_finetune.py --config NAME
"""

# `hf-scale recipes copy NAME`: the recipe files in hf_scale/recipes/.
RECIPE_FILES = {"finetune": "finetune_llama2.py", "dpo": "dpo_llama2.py", "search": "search_llama2.py"}


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def render_plan(result) -> str:
    """The plan as a table, the recommendation and any advice."""
    w = result.workload
    lines = [
        f"{result.shape.name}: {result.shape.parameters / 1e9:.2f}B parameters on {w.nodes} node(s) x "
        f"{w.gpus_per_node} {w.gpu.name} ({_gib(w.gpu.memory_bytes)} GiB), seq {w.seq_len}, micro batch "
        f"{w.micro_batch}, gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}",
        "GiB per GPU; host GiB per node; seconds per step at peak (communication not overlapped)",
        f"{'strategy':<14}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'other':>8}{'total':>8}"
        f"{'host':>8}{'fits':>6}{'comm s':>9}{'compute s':>11}",
    ]
    for name, e in result.estimates.items():
        lines.append(
            f"{name:<14}{_gib(e.parameters):>8}{_gib(e.gradients):>8}{_gib(e.optimizer_states):>8}"
            f"{_gib(e.activations):>8}{_gib(e.overhead):>8}{_gib(e.total):>8}{_gib(e.cpu_per_node):>8}"
            f"{'yes' if e.fits else 'no':>6}{e.communication_seconds:>9.3f}{e.compute_seconds:>11.3f}"
            + ("  communication-bound" if e.communication_bound else "")
        )
    if result.recommendation:
        preset = {"ddp": "no zero_preset (plain DDP)"}.get(
            result.recommendation, f"zero_preset: {result.recommendation}"
        )
        lines.append(f"recommendation: {result.recommendation} ({preset}), the fastest that fits in 90% of memory")
    else:
        lines.append("recommendation: nothing fits; " + "; ".join(result.advice))
    return "\n".join(lines)


def plan_command(options: argparse.Namespace) -> None:
    from hf_scale.hardware import get_gpu
    from hf_scale.memory import Workload, plan
    from hf_scale.model_shapes import model_shape

    gpu = get_gpu(options.gpu)
    if options.gpus < 1 or options.nodes < 1 or options.seq_len < 1 or options.micro_batch < 1:
        raise HfScaleError("--gpus, --nodes, --seq-len and --micro-batch must be positive")
    workload = Workload(
        gpu=gpu,
        gpus_per_node=options.gpus,
        nodes=options.nodes,
        seq_len=options.seq_len,
        micro_batch=options.micro_batch,
        gradient_checkpointing=options.grad_ckpt,
        lora_r=options.lora_r,
        quantization=options.quantization,
    )
    result = plan(model_shape(options.model), workload)
    summary = {
        "model": dataclasses.asdict(result.shape),
        "workload": {**dataclasses.asdict(workload), "gpu": dataclasses.asdict(gpu)},
        "strategies": {name: {**dataclasses.asdict(e), "total": e.total} for name, e in result.estimates.items()},
        "recommendation": result.recommendation,
        "advice": result.advice,
    }
    print(json.dumps(summary, indent=2) if options.json else render_plan(result))


def presets_command(options: argparse.Namespace) -> None:
    from hf_scale.presets import list_presets, zero_preset

    if options.action == "list":
        for name in list_presets():
            config = zero_preset(name)
            tensor_parallel = config.get("tensor_parallel", {}).get("autotp_size")
            offload = [kind for kind in ("optimizer", "param") if f"offload_{kind}" in config["zero_optimization"]]
            print(
                f"{name:<26} ZeRO-{config['zero_optimization']['stage']}"
                + (f" + AutoTP tensor parallel {tensor_parallel}" if tensor_parallel else "")
                + (f", {' and '.join(offload)} offloaded to CPU" if offload else "")
            )
    else:
        if not options.name:
            raise HfScaleError("presets show needs a preset name: hf-scale presets show zero2")
        print(json.dumps(zero_preset(options.name), indent=2))


def env_command(options: argparse.Namespace) -> None:
    from hf_scale.environment import environment_report, render_environment

    report = environment_report()
    print(json.dumps(report, indent=2) if options.json else render_environment(report))


def recipe_command(options: argparse.Namespace) -> None:
    """`train`, `dpo` and `search`: the recipe `options.recipe` (a key of RECIPE_FILES) with the flags given."""
    if "-h" in options.recipe_args or "--help" in options.recipe_args:
        print(options.examples)  # then the recipe's own help: how to launch it and every flag
    recipe = importlib.import_module(f"hf_scale.recipes.{RECIPE_FILES[options.recipe].removesuffix('.py')}")
    recipe.main(options.recipe_args)


def recipes_command(options: argparse.Namespace) -> None:
    from hf_scale.config import config_file, shipped_configs

    if options.action == "list":
        for name in shipped_configs():
            first_line = config_file(name).read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
            print(f"{name:<36} {first_line}")
        return
    if options.recipe not in RECIPE_FILES or not options.destination:
        raise HfScaleError(f"recipes copy needs a recipe ({' or '.join(RECIPE_FILES)}) and a destination file")
    destination = Path(options.destination)
    if destination.exists():
        raise HfScaleError(f"{destination} exists: hf-scale recipes copy does not overwrite")
    shutil.copyfile(Path(__file__).parent / "recipes" / RECIPE_FILES[options.recipe], destination)
    print(f"copied the {options.recipe} recipe to {destination}; launch it as the original (see its docstring)")


def report_command(options: argparse.Namespace) -> None:
    from hf_scale.hpo.report import load_study, render_summary, trials_table, write_report

    study = load_study(options.study, options.study_name)
    print(render_summary(study, trials_table(study)))
    if options.out:
        print(f"trials table and plots in {write_report(study, options.out)}")


CHAT_EXAMPLES = """examples:
  hf-scale chat outputs/tiny-cpu                               # a conversation (/reset, /system TEXT, /exit)
  hf-scale chat outputs/tiny-cpu --prompt "What is 417 plus one?"   # one answer, for scripts
  echo "What is 417 plus one?" | hf-scale chat outputs/tiny-cpu     # one turn per line of standard input
"""

EXPORT_EXAMPLES = """examples:
  hf-scale export outputs/tiny-cpu exported/tiny
  hf-scale export outputs/llama2-7b-lora exported/llama2-7b-merged --merge-lora
  hf-scale export outputs/llama2-7b-lora exported/llama2-7b-q8_0.gguf --format gguf --gguf_type q8_0
"""


def chat_command(options: argparse.Namespace) -> None:
    from hf_scale.chat import chat_with_run

    chat_with_run(options)


def export_command(options: argparse.Namespace) -> None:
    from hf_scale.export import export_run

    export_run(
        options.run_dir,
        options.out,
        merge_lora=options.merge_lora,
        dtype=options.dtype,
        quantization=options.quantization,
        format=options.format,
        gguf_type=options.gguf_type,
    )


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported on one line (and where the help is) instead of usage + error, and
    the examples of each epilog kept as written."""

    def __init__(self, *args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_argument(self, *names, **kwargs):
        """Each `--two-words` flag also as `--two_words`: `hf-scale train` (HfArgumentParser) takes both spellings,
        so every command does; the help shows the first."""
        spellings = [
            *names,
            *("--" + name[2:].replace("-", "_") for name in names if name.startswith("--") and "-" in name[2:]),
        ]
        return super().add_argument(*spellings, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hf-scale", description="Instruction fine-tuning at scale, in the HF API.", epilog=MAIN_EXAMPLES
    )
    commands = parser.add_subparsers(dest="command", required=True)

    plan_parser = commands.add_parser(
        "plan", help="memory per GPU for each strategy, and which to pick", epilog=PLAN_EXAMPLES
    )
    plan_parser.add_argument("--model", required=True, help="hub id, local folder, or a known LLaMA-2 id (offline)")
    plan_parser.add_argument(
        "--gpu", required=True, help="a100-40g, a100-80g, rtx4090-24g, l40s-48g, h100-80g, h200-141g"
    )
    plan_parser.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    plan_parser.add_argument("--nodes", type=int, default=1)
    plan_parser.add_argument("--seq-len", type=int, default=512)
    plan_parser.add_argument("--micro-batch", type=int, default=1, help="per-GPU batch")
    plan_parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    plan_parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank for the LoRA and QLoRA rows")
    plan_parser.add_argument(
        "--quantization", choices=["nf4", "fp4", "int8"], default="nf4", help="the QLoRA row's quantized base"
    )
    plan_parser.add_argument("--json", action="store_true", help="machine-readable output")
    plan_parser.set_defaults(run=plan_command)

    presets_parser = commands.add_parser("presets", help="the shipped DeepSpeed ZeRO presets", epilog=PRESETS_EXAMPLES)
    presets_parser.add_argument("action", choices=["list", "show"])
    presets_parser.add_argument("name", nargs="?", help="preset to show")
    presets_parser.set_defaults(run=presets_command)

    def add_recipe_command(name: str, recipe: str, what: str, examples: str) -> None:
        where = f"the recipe hf_scale/recipes/{RECIPE_FILES[recipe]}; accelerate launch -m hf_scale.cli {name}"
        # -h and every flag belong to the recipe
        recipe_parser = commands.add_parser(name, help=f"{what} ({where})", add_help=False, prefix_chars="\0")
        recipe_parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's flags, e.g. --config X")
        recipe_parser.set_defaults(run=recipe_command, recipe=recipe, examples=examples)

    add_recipe_command("train", "finetune", "fine-tune", TRAIN_EXAMPLES)
    add_recipe_command("dpo", "dpo", "preference-tune after fine-tuning: DPO, IPO, hinge, SimPO, ORPO", DPO_EXAMPLES)

    env_parser = commands.add_parser(
        "env", help="versions, devices, DeepSpeed ops and what is missing", epilog=ENV_EXAMPLES
    )
    env_parser.add_argument("--json", action="store_true", help="machine-readable output")
    env_parser.set_defaults(run=env_command)

    add_recipe_command("search", "search", "hyperparameter search", SEARCH_EXAMPLES)

    recipes_parser = commands.add_parser(
        "recipes", help="the shipped configs (for --config NAME); copy a recipe out to edit", epilog=RECIPES_EXAMPLES
    )
    recipes_parser.add_argument("action", choices=["list", "copy"])
    recipes_parser.add_argument("recipe", nargs="?", help="for copy: finetune, dpo or search")
    recipes_parser.add_argument("destination", nargs="?", help="for copy: the new file")
    recipes_parser.set_defaults(run=recipes_command)

    report_parser = commands.add_parser(
        "report", help="trials table and plots of a search's study", epilog=REPORT_EXAMPLES
    )
    report_parser.add_argument("study", help="a study file (optuna_study.db, a journal file) or a storage URL")
    report_parser.add_argument("--study-name", help="needed when the storage holds several studies")
    report_parser.add_argument("--out", help="folder for trials.csv, trials.json and the plots")
    report_parser.set_defaults(run=report_command)

    chat_parser = commands.add_parser(
        "chat", help="talk to a trained run (its model, adapter and chat template)", epilog=CHAT_EXAMPLES
    )
    chat_parser.add_argument(
        "run_dir", help="a run's output_dir (or a checkpoint or export folder, a .gguf file, packaged:NAME)"
    )
    chat_parser.add_argument("--prompt", help="answer this one message and exit")
    chat_parser.add_argument("--system", help="system prompt (when the chat template takes one)")
    chat_parser.add_argument("--max-new-tokens", type=int, default=256)
    chat_parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    chat_parser.add_argument("--temperature", type=float, default=0.7, help="with --do-sample")
    chat_parser.add_argument("--top-p", type=float, default=0.9, help="with --do-sample")
    chat_parser.add_argument("--seed", type=int, default=0, help="with --do-sample")
    chat_parser.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: the GPU when there is one"
    )
    chat_parser.set_defaults(run=chat_command)

    export_parser = commands.add_parser(
        "export",
        help="a plain HF model folder (or a GGUF file for llama.cpp) from a run, loadable without hf_scale",
        epilog=EXPORT_EXAMPLES,
    )
    export_parser.add_argument(
        "run_dir", help="a run's output_dir (or one of its checkpoints, a .gguf file, packaged:NAME)"
    )
    export_parser.add_argument("out", help="the new folder, or with --format gguf the new .gguf file (must not exist)")
    export_parser.add_argument(
        "--format",
        choices=["hf", "gguf"],
        default="hf",
        help="hf: a transformers folder; gguf: one file for llama.cpp, Ollama and LM Studio (LoRA merged, tokenizer "
        "and chat template inside; LLaMA-architecture models)",
    )
    export_parser.add_argument(
        "--gguf_type",
        "--gguf-type",
        choices=["f32", "f16", "bf16", "q8_0"],
        default="f16",
        help="with --format gguf: the type of the 2-D weights (the norms stay f32)",
    )
    export_parser.add_argument(
        "--merge-lora", action="store_true", help="merge a LoRA adapter into its base (else the adapter is copied)"
    )
    export_parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="auto: the base's dtype"
    )
    export_parser.add_argument(
        "--quantization",
        choices=["none", "nf4", "fp4", "int8"],
        help="with --merge-lora, for an adapter folder without its run's run_config.json (copied out of its run, "
        "or from the hub): how the "
        "adapter's base was loaded in training (nf4, fp4, int8: QLoRA, with the recipe's double quantization and "
        "bfloat16 compute; none: unquantized)",
    )
    export_parser.set_defaults(run=export_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`hf-scale ARGV`; without `argv` (the console script), this process's command line, in a process of its own."""
    if argv is None:
        from hf_scale.recipes import preparation

        preparation.own_process = True
    options = build_parser().parse_args(argv)
    try:
        options.run(options)
    except HfScaleError as error:
        print(f"hf-scale: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
