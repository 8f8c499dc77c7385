"""What the fine-tuning and search recipes both do before training: arguments, records, tokenizer, examples."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from datasets import Dataset
from transformers import HfArgumentParser, PreTrainedTokenizerBase

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import check_config, parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.cache import cached_tokenize_records
from hf_scale.data.loading import RecordCheck, load_records, split_records
from hf_scale.data.templates import CHAT_TEMPLATE, PromptTemplate, get_template
from hf_scale.data.tokenize import TokenizationSummary, check_examples_left, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.modeling import ModelArguments, check_model_path, load_tokenizer
from hf_scale.paths import cache_dir
from hf_scale.tiny import ensure_tiny_model, generate_tasks


def parse_recipe_arguments(argv: list[str], dataclass_types: tuple, default_config: str, usage: str) -> tuple:
    """The recipe's dataclasses from `--config` (a file or a shipped name; `default_config` without one) and flags.

    The first three types are ModelArguments, DataArguments and ScaleTrainingArguments. Every mistake stops here,
    before any work; with -h, `usage` (how to launch the recipe) is printed before the parser's help.
    """
    if "-h" in argv or "--help" in argv:
        print(usage)
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        argv = ["--config", default_config, *argv]
    parser = HfArgumentParser(dataclass_types)
    values = check_config(parser, argv)
    if values["zero_preset"] == "auto" and not values["plan_model"] and values["model_name_or_path"]:
        argv = [*argv, "--plan_model", values["model_name_or_path"]]  # the planner sizes the model we train
    parsed = parse_config(parser, argv)
    model_args, data_args = parsed[0], parsed[1]
    if data_args.template != CHAT_TEMPLATE:  # the tokenizer's chat template is checked once it is loaded
        get_template(data_args.template, data_args.system_prompt)
    if model_args.model_name_or_path:
        check_model_path(model_args.model_name_or_path)
    return parsed


@dataclass
class PreparedData:
    """The model's path, its tokenizer and prompt template, and the tokenized train and eval examples."""

    model_path: str
    tokenizer: PreTrainedTokenizerBase
    template: PromptTemplate
    train_dataset: Dataset
    eval_dataset: Dataset
    train_summary: TokenizationSummary
    eval_summary: TokenizationSummary
    eval_records: list[dict[str, str]]
    record_checks: list[RecordCheck]  # what became of each loaded file's records (none for the generated tasks)


def prepare_data(model_args: ModelArguments, data_args: DataArguments, args: ScaleTrainingArguments) -> PreparedData:
    """Records (each one checked; a held-out split), the tokenizer, and examples labelled on the response only."""
    load = partial(load_records, fields=data_args.fields, on_bad_record=data_args.on_bad_record)
    record_checks = []
    if data_args.dataset is None:
        train_records, eval_records = generate_tasks()
    elif data_args.eval_dataset:
        train_records, train_check = load(data_args.dataset)
        eval_records, eval_check = load(data_args.eval_dataset, key="eval_dataset")
        record_checks = [train_check, eval_check]
    else:
        records, train_check = load(data_args.dataset)
        train_records, eval_records = split_records(records, data_args.eval_ratio, args.seed)
        record_checks = [train_check]

    model_path = model_args.model_name_or_path
    if model_path is None:
        with args.main_process_first(desc="building the embedded tiny model"):
            model_path = str(ensure_tiny_model())
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)
    template = get_template(data_args.template, data_args.system_prompt, tokenizer)
    settings: dict[str, Any] = dict(
        max_length=data_args.max_length, train_on_inputs=data_args.train_on_inputs, truncation=data_args.truncation
    )
    tokenize = partial(tokenize_records, **settings)
    if data_args.cache_tokenized:
        tokenize = partial(cached_tokenize_records, cache_dir=cache_dir() / "tokenized", **settings)
    with args.main_process_first(desc="tokenizing"):
        train_dataset, train_summary, *_ = tokenize(
            train_records, tokenizer, template, num_proc=data_args.preprocessing_num_workers
        )
        eval_dataset, eval_summary, *_ = tokenize(eval_records, tokenizer, template)
    for name, summary in (("train", train_summary), ("eval", eval_summary)):
        check_examples_left(name, summary, data_args.max_length, data_args.truncation)
    return PreparedData(
        model_path,
        tokenizer,
        template,
        train_dataset,
        eval_dataset,
        train_summary,
        eval_summary,
        eval_records,
        record_checks,
    )


def run_as_program(main: Callable[[list[str]], dict]) -> None:
    """A recipe's `main` on this process's command line; a mistake in it is one line (`error: ...`) and exit 2."""
    try:
        main(sys.argv[1:])
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
