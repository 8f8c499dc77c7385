#!/usr/bin/env python
"""Search the fine-tuning hyperparameters of a LLaMA-2-class model with Optuna, through ScaleTrainer.

With no arguments it searches the learning rate, batch, schedule and warm-up of the embedded tiny LLaMA on the
generated tasks, on any CPU, in a few minutes:

    hf-scale search
    torchrun --nproc_per_node 2 -m hf_scale.cli search            # every trial on 2 processes
    python recipes/search_llama2.py                               # from a clone: the same recipe

On GPU nodes, a config picks the model, the data, the trial length and the search (ranges, trials, storage):

    accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml -m hf_scale.cli search \\
        --config search_llama2_7b_lora

Several trials at once on one node, each on its share of the GPUs (started as one process, which starts the
workers, then reloads the best trial and reports once):

    hf-scale search --config search_llama2_7b_lora --parallel_trials 4 --pruner asha

Several nodes can work on one study: give every worker the same `storage` (a PostgreSQL URL, or journal:PATH on a
shared filesystem) and start one launch per node; each runs its own trials, the study holds them all, and the search
ends when the study holds n_trials. An interrupted search started again with the same output_dir (or storage)
continues where it stopped. `hf-scale report output_dir/optuna_study.db` shows the trials at any time.
"""

import json
from dataclasses import asdict
from pathlib import Path

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.data.arguments import DataArguments
from hf_scale.data.batching import make_collator
from hf_scale.hpo import SearchArguments, SpaceArguments, default_hp_space
from hf_scale.modeling import ModelArguments, load_model
from hf_scale.recipes.preparation import parse_recipe_arguments, prepare_data, run_as_program
from hf_scale.trainer import ScaleTrainer


def main(argv: list[str]) -> dict:
    # 1. Arguments: the YAML config, then flags on top; the search's own settings beside the training ones.
    model_args, data_args, args, search_args, space_args = parse_recipe_arguments(
        argv,
        (ModelArguments, DataArguments, ScaleTrainingArguments, SearchArguments, SpaceArguments),
        "search_tiny_cpu",
        __doc__,
    )
    args = prepare_run(args, model_args)  # zero_preset auto planned, output_dir writable

    # 2. Data and tokenizer, once: every trial trains on the same examples.
    data = prepare_data(model_args, data_args, args)
    model_path, tokenizer = data.model_path, data.tokenizer

    # 3. A fresh model for each trial (with LoRA adapters when lora_r > 0: then only the adapters are re-created).
    trainer = ScaleTrainer(
        model_init=lambda: load_model(model_args, model_path, tokenizer),
        args=args,
        train_dataset=data.train_dataset,
        eval_dataset=data.eval_dataset,
        data_collator=make_collator(tokenizer, data_args.packing, data_args.pad_to_multiple_of),
        processing_class=tokenizer,
    )
    hp_space = default_hp_space(
        args.data_parallel_size, model_args.lora_r > 0, space_args, min_learning_rate=args.min_learning_rate
    )

    # 4. The search: the best trial's model ends in output_dir/best-model, the report in output_dir/hpo-report.
    search = {key: value for key, value in vars(search_args).items() if key not in ("n_trials", "direction")}
    best = trainer.hyperparameter_search(
        hp_space=hp_space, n_trials=search_args.n_trials, direction=search_args.direction, **search
    )
    results = {"best_trial": best.run_id, "objective": best.objective, "hyperparameters": best.hyperparameters}
    if trainer.is_world_process_zero():
        output_dir = Path(args.output_dir)
        (output_dir / "best_run.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        # How the base was loaded (a QLoRA search's quantization): chat and export read it one folder up from
        # best-model. The trials' own values are in best_run.json.
        run_config = {"model": asdict(model_args), "data": asdict(data_args), "training": args.to_sanitized_dict()}
        (output_dir / "run_config.json").write_text(json.dumps(run_config, indent=2, default=str) + "\n")
        print(f"best trial {best.run_id}: {args.metric_for_best_model or 'eval_loss'} {best.objective:.4g} with")
        print(json.dumps(best.hyperparameters, indent=2, default=str))
    trainer.accelerator.end_training()  # the process group ends before the interpreter does
    return results


if __name__ == "__main__":
    run_as_program(main)
