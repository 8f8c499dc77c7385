#!/usr/bin/env python
"""Search the fine-tuning hyperparameters of a LLaMA-2-class model with Optuna, through ScaleTrainer.

With no arguments it searches the learning rate, batch, schedule and warm-up of the embedded tiny LLaMA on the
generated tasks, on any CPU, in a few minutes:

    python recipes/search_llama2.py
    torchrun --nproc_per_node 2 recipes/search_llama2.py          # every trial on 2 processes

On GPU nodes, a config picks the model, the data, the trial length and the search (ranges, trials, storage):

    accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml recipes/search_llama2.py \\
        --config recipes/configs/search_llama2_7b_lora.yaml

Several nodes can work on one study: give every worker the same `storage` (a PostgreSQL URL, or journal:PATH on a
shared filesystem) and start one launch per node; each runs its own trials, the study holds them all, and the search
ends when the study holds n_trials. An interrupted search started again with the same output_dir (or storage)
continues where it stopped. `hf-scale report output_dir/optuna_study.db` shows the trials at any time.
"""

import json
import sys
from pathlib import Path

from transformers import HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.loading import load_records, split_records
from hf_scale.data.templates import get_template
from hf_scale.data.tokenize import tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.hpo import SearchArguments, default_hp_space
from hf_scale.hpo.settings import SpaceArguments
from hf_scale.modeling import ModelArguments, check_model_path, load_model, load_tokenizer
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "search_tiny_cpu.yaml"


def main(argv: list[str]) -> dict:
    # 1. Arguments: the YAML config, then flags on top; the search's own settings beside the training ones.
    if "-h" in argv or "--help" in argv:
        print(__doc__)  # how to launch it; the parser's help, with every flag, follows
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    parser = HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments, SearchArguments, SpaceArguments))
    model_args, data_args, args, search_args, space_args = parse_config(parser, argv)
    space_settings = space_args.settings()
    if model_args.model_name_or_path:
        check_model_path(model_args.model_name_or_path)

    # 2. Data: the generated tasks by default, else Alpaca records with a held-out split.
    if data_args.dataset is None:
        train_records, eval_records = generate_tasks()
    else:
        records, _ = load_records(data_args.dataset, fields=data_args.fields, on_bad_record=data_args.on_bad_record)
        if data_args.eval_dataset:
            eval_records, _ = load_records(data_args.eval_dataset, fields=data_args.fields, key="eval_dataset")
            train_records = records
        else:
            train_records, eval_records = split_records(records, data_args.eval_ratio, args.seed)

    # 3. Tokenizer and tokenized examples (once: every trial trains on the same examples).
    model_path = model_args.model_name_or_path
    if model_path is None:
        with args.main_process_first(desc="building the embedded tiny model"):
            model_path = str(ensure_tiny_model())
    tokenizer = load_tokenizer(model_path)
    template = get_template(data_args.template, data_args.system_prompt, tokenizer)
    settings = dict(
        max_length=data_args.max_length, train_on_inputs=data_args.train_on_inputs, truncation=data_args.truncation
    )
    with args.main_process_first(desc="tokenizing"):
        train_dataset, _ = tokenize_records(train_records, tokenizer, template, **settings)
        eval_dataset, _ = tokenize_records(eval_records, tokenizer, template, **settings)

    # 4. A fresh model for each trial (with LoRA adapters when lora_r > 0: then only the adapters are re-created).
    trainer = ScaleTrainer(
        model_init=lambda: load_model(model_args, model_path, tokenizer),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=make_collator(tokenizer, data_args.packing, data_args.pad_to_multiple_of),
        processing_class=tokenizer,
    )
    hp_space = default_hp_space(
        args.data_parallel_size, model_args.lora_r > 0, space_settings, min_learning_rate=args.min_learning_rate
    )

    # 5. The search: the best trial's model ends in output_dir/best-model, the report in output_dir/hpo-report.
    search = {key: value for key, value in vars(search_args).items() if key not in ("n_trials", "direction")}
    best = trainer.hyperparameter_search(
        hp_space=hp_space, n_trials=search_args.n_trials, direction=search_args.direction, **search
    )
    results = {"best_trial": best.run_id, "objective": best.objective, "hyperparameters": best.hyperparameters}
    if trainer.is_world_process_zero():
        (Path(args.output_dir) / "best_run.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"best trial {best.run_id}: {args.metric_for_best_model or 'eval_loss'} {best.objective:.4g} with")
        print(json.dumps(best.hyperparameters, indent=2, default=str))
    trainer.accelerator.end_training()  # the process group ends before the interpreter does
    return results


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
