"""What the fine-tuning and search recipes both do before training: arguments, records, tokenizer, examples."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import zip_longest
from typing import Any

from datasets import Dataset, concatenate_datasets
from transformers import HfArgumentParser, PreTrainedTokenizerBase

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import check_config, parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.cache import cached_tokenize_records
from hf_scale.data.conversations import load_conversations
from hf_scale.data.loading import OnBadRecord, RecordCheck, load_records, split_records
from hf_scale.data.mixture import DataSource, mix
from hf_scale.data.multiturn import (
    CONVERSATION_TEMPLATES,
    ConversationSummary,
    chat_template_for,
    render,
    tokenize_conversations,
)
from hf_scale.data.templates import CHAT_TEMPLATE, PromptTemplate, get_template
from hf_scale.data.tokenize import TokenizationSummary, check_examples_left, tokenize_records
from hf_scale.distributed import set_single_process_launch_environment
from hf_scale.errors import ConfigError, HfScaleError
from hf_scale.gguf_source import ensure_converted, gguf_path, is_gguf_source
from hf_scale.modeling import ModelArguments, check_model_path, load_tokenizer
from hf_scale.paths import cache_dir
from hf_scale.tiny import ensure_tiny_model, generate_conversation_tasks, generate_tasks

# Whether this process is the recipe's own (`python recipes/...`, `hf-scale train`): then its environment is the
# recipe's to set (run_as_program and the hf-scale command say so). A recipe's `main` called from a script, a notebook
# or a test leaves its caller's environment alone.
own_process = False


def parse_recipe_arguments(argv: list[str], dataclass_types: tuple, default_config: str, usage: str) -> tuple:
    """The recipe's dataclasses from `--config` (a file or a shipped name; `default_config` without one) and flags.

    The first three types are ModelArguments, DataArguments and ScaleTrainingArguments. Every mistake stops here,
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
    conversational = [source.name for source in data_args.sources() if source.is_conversations]
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
    responses only, and the sources mixed."""
    sources = data_args.sources()
    loaded = [load_source(source, data_args.on_bad_record, data_args.eval_ratio, args.seed) for source in sources]

    model_path = model_args.model_name_or_path
    if model_path is None:
        with args.main_process_first(desc="building the embedded tiny model"):
            model_path = str(ensure_tiny_model())
    elif is_gguf_source(model_path, model_args.gguf_file):
        with args.main_process_first(desc="converting the GGUF file"):
            model_path = str(ensure_converted(gguf_path(model_path, model_args.gguf_file)))
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)
    template = get_template(data_args.template, data_args.system_prompt, tokenizer)
    # The run's template goes with the tokenizer it saves, so that `hf-scale chat`, an export and any
    # `apply_chat_template` format prompts as the model was trained (a JSON user template has no chat form).
    # (`template: chat_template` is the tokenizer's own: CONVERSATION_TEMPLATES holds None for it, and it stays.)
    tokenizer.chat_template = CONVERSATION_TEMPLATES.get(data_args.template) or tokenizer.chat_template
    if data_args.template.lstrip().startswith("{"):
        tokenizer.chat_template = None
    with args.main_process_first(desc="tokenizing"):
        prepared = [
            tokenize_source(source, train, held_out, checks, tokenizer, template, data_args)
            for source, (train, held_out, checks) in zip(sources, loaded, strict=True)
        ]
    train_dataset, drawn = mix(
        [source.train_dataset for source in prepared], [s.weight for s in sources], data_args.mixture, args.seed
    )
    eval_dataset = concatenate_datasets([source.eval_dataset for source in prepared])
    held_out = [record for group in zip_longest(*(s.held_out for s in prepared)) for record in group if record]
    return PreparedData(model_path, tokenizer, template, train_dataset, eval_dataset, prepared, drawn, held_out)


def load_source(source: DataSource, on_bad_record: OnBadRecord, eval_ratio: float, seed: int) -> tuple:
    """(train items, held-out items, record checks) of one source: Alpaca records or conversations."""
    if source.path is None:
        train, held_out = generate_conversation_tasks() if source.is_conversations else generate_tasks()
        return train, held_out, []
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


def tokenize_source(
    source: DataSource,
    train: list,
    held_out: list,
    record_checks: list[RecordCheck],
    tokenizer: PreTrainedTokenizerBase,
    template: PromptTemplate,
    data_args: DataArguments,
) -> SourceData:
    """One source's train and held-out examples, labelled on the responses (or assistant turns) only."""
    settings: dict[str, Any] = dict(
        max_length=data_args.max_length, train_on_inputs=data_args.train_on_inputs, truncation=data_args.truncation
    )
    if source.is_conversations:
        chat_template = chat_template_for(data_args.template, tokenizer)
        if data_args.system_prompt:  # the run's system prompt, where a conversation brings none of its own
            system = [{"role": "system", "content": data_args.system_prompt}]
            train, held_out = ([system + t if t[0]["role"] != "system" else t for t in c] for c in (train, held_out))
        tokenize = partial(
            tokenize_conversations, template=chat_template, assistant_turns=data_args.assistant_turns, **settings
        )
        (train_dataset, train_summary), (eval_dataset, eval_summary) = (
            tokenize(train, tokenizer),
            tokenize(held_out, tokenizer),
        )
        last_turns = [
            {
                "prompt_ids": tokenizer(
                    render(tokenizer, chat_template, turns[:-1], generation_prompt=True), add_special_tokens=False
                )["input_ids"],
                "output": turns[-1]["content"],
            }
            for turns in held_out[: data_args.exact_match_samples]
        ]
        return SourceData(source, record_checks, train_dataset, eval_dataset, train_summary, eval_summary, last_turns)
    tokenize = partial(tokenize_records, **settings)
    if data_args.cache_tokenized:
        tokenize = partial(cached_tokenize_records, cache_dir=cache_dir() / "tokenized", **settings)
    train_dataset, train_summary, *_ = tokenize(
        train, tokenizer, template, num_proc=data_args.preprocessing_num_workers
    )
    eval_dataset, eval_summary, *_ = tokenize(held_out, tokenizer, template)
    for name, summary in (("train", train_summary), ("eval", eval_summary)):
        check_examples_left(name, summary, data_args.max_length, data_args.truncation, source.name)
    return SourceData(
        source,
        record_checks,
        train_dataset,
        eval_dataset,
        train_summary,
        eval_summary,
        held_out[: data_args.exact_match_samples],
    )


def run_as_program(main: Callable[[list[str]], dict]) -> None:
    """A recipe's `main` on this process's command line; a mistake in it is one line (`error: ...`) and exit 2."""
    global own_process
    own_process = True
    try:
        main(sys.argv[1:])
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
