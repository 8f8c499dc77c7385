"""What the fine-tuning and search recipes both do before training: arguments, records, tokenizer, examples."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import zip_longest
from pathlib import Path
from typing import Any

from datasets import Dataset, concatenate_datasets
from transformers import HfArgumentParser, PreTrainedTokenizerBase

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import check_config, parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.cache import (
    COMPLETE,
    cached_folder,
    dataset_files,
    digest,
    read_dataset,
    temporary_folder,
    tokenizer_digest,
)
from hf_scale.data.conversations import load_conversations
from hf_scale.data.loading import OnBadRecord, RecordCheck, data_identity, load_records, split_records
from hf_scale.data.mixture import DataSource, mix
from hf_scale.data.multiturn import (
    CONVERSATION_TEMPLATES,
    ConversationSummary,
    chat_template_for,
    render_all,
    tokenize_conversations,
)
from hf_scale.data.templates import CHAT_TEMPLATE, PromptTemplate, get_template
from hf_scale.data.tokenize import TokenizationSummary, check_examples_left, examples_of, tokenize_records
from hf_scale.distributed import set_single_process_launch_environment
from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.gguf_source import ensure_converted, gguf_path, is_gguf_source
from hf_scale.modeling import ModelArguments, check_model_path, load_tokenizer
from hf_scale.paths import cache_dir
from hf_scale.plotting import plot_learning_rate, plot_loss_curve
from hf_scale.tiny import ensure_tiny_model, generate_conversation_tasks, generate_tasks

# Whether this process is the recipe's own (`python recipes/...`, `hf-scale train`): then its environment is the
# recipe's to set (run_as_program and the hf-scale command say so). A recipe's `main` called from a script, a notebook
# or a test leaves its caller's environment alone.
own_process = False


def parse_recipe_arguments(argv: list[str], dataclass_types: tuple, default_config: str, usage: str) -> tuple:
    """The recipe's dataclasses from `--config` (a file or a shipped name; `default_config` without one) and flags.

    The first three types are ModelArguments, the data arguments (DataArguments, or the preference recipe's) and
    ScaleTrainingArguments (or a subclass). Every mistake stops here,
    before any work; with -h, `usage` (how to launch the recipe) is printed before the parser's help. In the recipe's
    own process, a DeepSpeed run that no launcher started gets a launcher's variables for one process.
    """
    if "-h" in argv or "--help" in argv:
        print(usage)
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        argv = ["--config", default_config, *argv]
    parser = HfArgumentParser(dataclass_types)
    values = check_config(parser, argv)
    if own_process and (values["zero_preset"] not in (None, "", "auto", "ddp") or values.get("deepspeed")):
        # One process that no launcher started (python, hf-scale train): DeepSpeed's engine needs what a launcher
        # sets, before the arguments' device setup starts the process group.
        set_single_process_launch_environment()
    if values["zero_preset"] == "auto" and not values["plan_model"] and values["model_name_or_path"]:
        argv = [*argv, "--plan_model", values["model_name_or_path"]]  # the planner sizes the model we train
    parsed = parse_config(parser, argv)
    model_args, data_args = parsed[0], parsed[1]
    if data_args.template != CHAT_TEMPLATE:  # the tokenizer's chat template is checked once it is loaded
        get_template(data_args.template, data_args.system_prompt)
    sources = data_args.sources() if isinstance(data_args, DataArguments) else []
    conversational = [source.name for source in sources if source.is_conversations]
    if conversational and data_args.template not in CONVERSATION_TEMPLATES:
        raise ConfigError(
            f"template: a JSON user template renders one-turn records only, and {conversational[0]} holds "
            f"conversations; use one of {', '.join(CONVERSATION_TEMPLATES)}"
        )
    if model_args.model_name_or_path:
        check_model_path(model_args.model_name_or_path)
    check_quantized_strategy(model_args, parsed[2])
    return parsed


def check_quantized_strategy(model_args: ModelArguments, args: ScaleTrainingArguments) -> None:
    """A quantized base trains with plain data parallelism only: each process holds its own quantized copy.

    ZeRO-3 and FSDP would shard bitsandbytes' packed weights, which they cannot do without a storage dtype that
    is not set up here; ZeRO-1/2 shard only the adapters' small optimizer states and are not tested with a
    quantized base. Each stops here, before any model is loaded.
    """
    if model_args.quantization is None:
        return
    if model_args.quantization == "int8" and args.device.type == "cpu":
        raise ConfigError(
            "quantization: int8 on CPU is refused: bitsandbytes' CPU int8 layers change at an evaluation (measured "
            "here: the adapters' gradients afterwards off by about 3 %); on CPU use nf4 or fp4"
        )
    sharded = args.zero_preset not in (None, "ddp", "auto") or args.deepspeed or args.fsdp  # auto: DDP or an error
    if sharded:
        how = f"zero_preset {args.zero_preset}" if args.zero_preset else ("deepspeed" if args.deepspeed else "fsdp")
        raise ConfigError(
            f"quantization: {model_args.quantization} trains with data parallelism only (each process holds its own "
            f"quantized base; the LoRA adapters are small), not with {how}: leave zero_preset, deepspeed and fsdp "
            "empty"
        )


@dataclass
class SourceData:
    """One source's records on their way to examples, everything counted."""

    source: DataSource
    record_checks: list[RecordCheck]  # what became of each loaded file's records (none for the embedded tasks)
    train_dataset: Dataset
    eval_dataset: Dataset
    train_summary: TokenizationSummary | ConversationSummary
    eval_summary: TokenizationSummary | ConversationSummary
    # Held-out records that generation answers: Alpaca records, or a conversation's last turn as its `prompt_ids`
    # (the history rendered with the generation prompt) and `output`.
    held_out: list[dict[str, Any]]
    reused: bool = False  # read from the cache that an earlier run or another process made


@dataclass
class PreparedData:
    """The model's path, its tokenizer and prompt template, and the mixed train and eval examples of every source."""

    model_path: str
    tokenizer: PreTrainedTokenizerBase
    template: PromptTemplate
    train_dataset: Dataset
    eval_dataset: Dataset
    sources: list[SourceData]
    drawn: list[int]  # the examples of each source in train_dataset (repeats included)
    held_out: list[dict[str, Any]]  # the sources' held-out records, taken in turn from each


def prepare_data(model_args: ModelArguments, data_args: DataArguments, args: ScaleTrainingArguments) -> PreparedData:
    """Each source's records (each one checked; a held-out split), the tokenizer, examples labelled on the
    responses only, and the sources mixed.

    The first process of each node (`main_process_first`) reads and tokenizes each source into the cache
    (`hf_scale.data.cache`); the others wait, then memory-map what it wrote, as a relaunch does."""
    sources = data_args.sources()
    model_path = model_folder(model_args, args)
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)
    template = get_template(data_args.template, data_args.system_prompt, tokenizer)
    # The run's template goes with the tokenizer it saves, so that `hf-scale chat`, an export and any
    # `apply_chat_template` format prompts as the model was trained (a JSON user template has no chat form).
    # (`template: chat_template` is the tokenizer's own: CONVERSATION_TEMPLATES holds None for it, and it stays.)
    tokenizer.chat_template = CONVERSATION_TEMPLATES.get(data_args.template) or tokenizer.chat_template
    if data_args.template.lstrip().startswith("{"):
        tokenizer.chat_template = None
    with args.main_process_first(desc="tokenizing"):
        prepared = [prepare_source(source, tokenizer, template, data_args, args.seed) for source in sources]
    train_dataset, drawn = mix(
        [source.train_dataset for source in prepared], [s.weight for s in sources], data_args.mixture, args.seed
    )
    eval_dataset = concatenate_datasets([source.eval_dataset for source in prepared])
    held_out = [record for group in zip_longest(*(s.held_out for s in prepared)) for record in group if record]
    return PreparedData(model_path, tokenizer, template, train_dataset, eval_dataset, prepared, drawn, held_out)


def model_folder(model_args: ModelArguments, args: ScaleTrainingArguments) -> str:
    """Where the model is loaded from: `model_name_or_path`, the embedded tiny model (built once) when it is empty,
    or the folder a GGUF file is converted into (once; the first process of each node converts, the others wait)."""
    model_path = model_args.model_name_or_path
    if model_path is None:
        with args.main_process_first(desc="building the embedded tiny model"):
            return str(ensure_tiny_model())
    if is_gguf_source(model_path, model_args.gguf_file):
        with args.main_process_first(desc="converting the GGUF file"):
            return str(ensure_converted(gguf_path(model_path, model_args.gguf_file)))
    return model_path


def prepare_source(
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    data_args: DataArguments,
    seed: int,
) -> SourceData:
    """One source's examples from the cache, made there first unless an earlier run or process did (`reused`).

    The embedded tasks and runs with `cache_tokenized` off are made in a folder of this process's own, removed at
    exit."""
    root = cache_dir() / "tokenized"
    identity = source_identity(source)
    if identity is None or not data_args.cache_tokenized:
        folder, reused = temporary_folder(root), False
        build_source(folder, source, tokenizer, template, data_args, seed)
    else:
        settings = {name: getattr(data_args, name) for name in KEY_SETTINGS}
        chat_template = tokenizer.chat_template if source.is_conversations else None
        key = digest(
            identity,
            dataclasses.asdict(source),
            settings,
            seed,
            dataclasses.asdict(template),
            chat_template,
            tokenizer_digest(tokenizer),
        )
        build = partial(
            build_source, source=source, tokenizer=tokenizer, template=template, data_args=data_args, seed=seed
        )
        folder, reused = cached_folder(root, key, build)
    info = json.loads((folder / COMPLETE).read_text())
    summary_type = ConversationSummary if source.is_conversations else TokenizationSummary
    return SourceData(
        source=source,
        record_checks=[
            RecordCheck(c["source"], c["records"], [tuple(s) for s in c["skipped"]]) for c in info["checks"]
        ],
        # the files hold a row a record, empty where the record was dropped
        train_dataset=examples_of(read_dataset(folder, info["train_files"]), info["train_summary"]["dropped_indices"]),
        eval_dataset=examples_of(read_dataset(folder, info["eval_files"]), info["eval_summary"]["dropped_indices"]),
        train_summary=summary_type(**info["train_summary"]),
        eval_summary=summary_type(**info["eval_summary"]),
        held_out=info["held_out"],
        reused=reused,
    )


# The data arguments a source's examples depend on (with the source, the template, the tokenizer and the seed).
KEY_SETTINGS = (
    "on_bad_record",
    "eval_ratio",
    "max_length",
    "truncation",
    "train_on_inputs",
    "assistant_turns",
    "system_prompt",
    "exact_match_samples",
)
# Sets at least this large are tokenized in one process a core: below it, starting the processes costs more.
PARALLEL_RECORDS = 10_000


def source_identity(source: DataSource) -> list | None:
    """What tells that a source's data changed: its files' paths, sizes and modification times (or a hub id's cached
    files); None for the embedded tasks, which are made again each time."""
    if source.path is None:
        return None
    return [
        data_identity(path, key) for path, key in ((source.path, "dataset"), (source.eval_path, "eval_dataset")) if path
    ]


def build_source(
    folder: Path,
    source: DataSource,
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    data_args: DataArguments,
    seed: int,
) -> None:
    """Read, check, split and tokenize one source into `folder`: Arrow files of the train and eval examples, and
    `info.json` (written last) with the record checks, the summaries and the held-out records generation answers."""
    train, held_out, checks = load_source(source, data_args.on_bad_record, data_args.eval_ratio, seed)
    # The records in split order, written out and memory-mapped: the loaded set leaves memory, and the processes
    # that tokenize read their share of a file instead of each receiving a copy.
    train = train.flatten_indices(cache_file_name=str(folder / "records-train.arrow"))
    held_out = held_out.flatten_indices(cache_file_name=str(folder / "records-eval.arrow"))
    settings: dict[str, Any] = dict(
        max_length=data_args.max_length, train_on_inputs=data_args.train_on_inputs, truncation=data_args.truncation
    )
    num_proc = data_args.preprocessing_num_workers
    if num_proc is None and len(train) >= PARALLEL_RECORDS:
        num_proc = len(os.sched_getaffinity(0))
    if source.is_conversations:
        chat_template = chat_template_for(data_args.template, tokenizer)
        tokenize = partial(
            tokenize_conversations,
            tokenizer=tokenizer,
            template=chat_template,
            assistant_turns=data_args.assistant_turns,
            system_prompt=data_args.system_prompt,
            **settings,
        )
        samples = held_out.select(range(min(data_args.exact_match_samples, len(held_out))))
        system = [{"role": "system", "content": data_args.system_prompt}] if data_args.system_prompt else []
        conversations = [t if t[0]["role"] == "system" else system + t for t in samples["turns"]]
        # Generation answers a conversation's last turn from the history rendered with the generation prompt.
        samples = [
            {"prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"], "output": turns[-1]["content"]}
            for turns, prompt in zip(
                conversations, render_all(tokenizer, chat_template, [t[:-1] for t in conversations], True), strict=True
            )
        ]
    else:
        tokenize = partial(tokenize_records, tokenizer=tokenizer, template=template, **settings)
        samples = held_out.select(range(min(data_args.exact_match_samples, len(held_out)))).to_list()
    train_dataset, train_summary = tokenize(train, num_proc=num_proc, cache_file_name=str(folder / "train.arrow"))
    eval_dataset, eval_summary = tokenize(held_out, cache_file_name=str(folder / "eval.arrow"))
    if not source.is_conversations:
        for name, summary in (("train", train_summary), ("eval", eval_summary)):
            check_examples_left(name, summary, data_args.max_length, data_args.truncation, source.name)
    info = {
        "checks": [dataclasses.asdict(check) for check in checks],
        "train_files": dataset_files(train_dataset, folder),
        "eval_files": dataset_files(eval_dataset, folder),
        "train_summary": dataclasses.asdict(train_summary),
        "eval_summary": dataclasses.asdict(eval_summary),
        "held_out": samples,
    }
    for path in folder.glob("*.arrow"):  # the records, written out to be tokenized
        if path.name not in info["train_files"] + info["eval_files"]:
            path.unlink()
    (folder / COMPLETE).write_text(json.dumps(info))


def load_source(source: DataSource, on_bad_record: OnBadRecord, eval_ratio: float, seed: int) -> tuple:
    """(train items, held-out items, record checks) of one source: Alpaca records or conversations, as Datasets."""
    if source.path is None:
        train, held_out = generate_conversation_tasks() if source.is_conversations else generate_tasks()
        if source.is_conversations:
            return Dataset.from_dict({"turns": train}), Dataset.from_dict({"turns": held_out}), []
        return Dataset.from_list(train), Dataset.from_list(held_out), []
    if source.is_conversations:
        load = partial(load_conversations, fields=source.conversation_fields, on_bad_record=on_bad_record)
    else:
        load = partial(load_records, fields=source.fields, on_bad_record=on_bad_record)
    if source.eval_path:
        (train, train_check), (held_out, eval_check) = load(source.path), load(source.eval_path, key="eval_dataset")
        return train, held_out, [train_check, eval_check]
    items, check = load(source.path)
    train, held_out = split_records(items, eval_ratio, seed)
    return train, held_out, [check]


def write_run_files(
    output_dir: str, results: dict, model_args: Any, data_args: Any, args: Any, log_history: list
) -> None:
    """A finished run's own files beside its model: metrics.json (the results), run_config.json (every argument, which
    chat and export read back), the loss curve and the learning-rate schedule."""
    folder = Path(output_dir)
    (folder / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    run_config = {"model": dataclasses.asdict(model_args), "data": dataclasses.asdict(data_args)}
    run_config["training"] = args.to_sanitized_dict()
    (folder / "run_config.json").write_text(json.dumps(run_config, indent=2, default=str) + "\n")
    plot_loss_curve(log_history, folder / "loss_curve.png")
    plot_learning_rate(log_history, folder / "learning_rate.png")


def run_as_program(main: Callable[[list[str]], dict]) -> None:
    """A recipe's `main` on this process's command line; a mistake in it is one line (`error: ...`) and exit 2."""
    global own_process
    own_process = True
    try:
        main(sys.argv[1:])
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
