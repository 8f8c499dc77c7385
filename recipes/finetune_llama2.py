#!/usr/bin/env python
"""Fine-tune a LLaMA-2-class model on Alpaca-style instruction data with hf_scale's ScaleTrainer.

With no arguments it trains the embedded tiny LLaMA on generated tasks, on any CPU, in about a minute:

    accelerate launch recipes/finetune_llama2.py

On GPU nodes, pick a config (and an accelerate config for the process layout):

    accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml recipes/finetune_llama2.py \\
        --config recipes/configs/llama2_7b_4xa100_zero1.yaml
    torchrun --nproc_per_node 8 recipes/finetune_llama2.py --config recipes/configs/llama2_13b_8xa100_zero2.yaml
    deepspeed --num_gpus 8 recipes/finetune_llama2.py --config recipes/configs/llama2_13b_8xa100_zero2.yaml

Every config key is also a flag, and flags win: `--learning_rate 3e-5 --output_dir runs/try2`.
`--resume` continues from the newest checkpoint in output_dir.
"""

import json
import sys
from functools import partial
from pathlib import Path

from transformers import HfArgumentParser

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import check_config, parse_config
from hf_scale.data.arguments import DataArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.cache import cached_tokenize_records
from hf_scale.data.loading import load_records, split_records
from hf_scale.data.summary import batching_of, describe_data, render_masked_example
from hf_scale.data.templates import CHAT_TEMPLATE, get_template
from hf_scale.data.tokenize import check_examples_left, tokenize_records
from hf_scale.errors import HfScaleError
from hf_scale.evaluation import GenerationEval
from hf_scale.modeling import ModelArguments, check_model_path, load_model, load_tokenizer
from hf_scale.paths import cache_dir
from hf_scale.plotting import plot_learning_rate, plot_loss_curve
from hf_scale.tiny import ensure_tiny_model, generate_tasks
from hf_scale.trainer import ScaleTrainer

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_cpu.yaml"


def main(argv: list[str]) -> dict:
    # 1. Arguments: the YAML config, then flags on top. Every mistake stops here, before any work.
    if "-h" in argv or "--help" in argv:
        print(__doc__)  # how to launch it; the parser's help, with every flag, follows
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    parser = HfArgumentParser((ModelArguments, DataArguments, ScaleTrainingArguments))
    values = check_config(parser, argv)
    if values["zero_preset"] == "auto" and not values["plan_model"] and values["model_name_or_path"]:
        argv = [*argv, "--plan_model", values["model_name_or_path"]]  # the planner sizes the model we train
    model_args, data_args, args = parse_config(parser, argv)
    if data_args.template != CHAT_TEMPLATE:  # the tokenizer's chat template is checked once it is loaded
        get_template(data_args.template, data_args.system_prompt)
    if model_args.model_name_or_path:
        check_model_path(model_args.model_name_or_path)

    # 2. Data: Alpaca records, each one checked, and a held-out split.
    load = partial(load_records, fields=data_args.fields, on_bad_record=data_args.on_bad_record)
    if data_args.dataset is None:
        train_records, eval_records = generate_tasks()
    elif data_args.eval_dataset:
        train_records, train_check = load(data_args.dataset)
        eval_records, eval_check = load(data_args.eval_dataset, key="eval_dataset")
    else:
        records, train_check = load(data_args.dataset)
        train_records, eval_records = split_records(records, data_args.eval_ratio, args.seed)

    # 3. Tokenizer and tokenized examples, labels exactly on the response and EOS.
    model_path = model_args.model_name_or_path
    if model_path is None:
        with args.main_process_first(desc="building the embedded tiny model"):
            model_path = str(ensure_tiny_model())
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)
    template = get_template(data_args.template, data_args.system_prompt, tokenizer)
    settings = dict(
        max_length=data_args.max_length, train_on_inputs=data_args.train_on_inputs, truncation=data_args.truncation
    )
    with args.main_process_first(desc="tokenizing"):
        if data_args.cache_tokenized:
            tokenize = partial(cached_tokenize_records, cache_dir=cache_dir() / "tokenized", **settings)
        else:
            tokenize = partial(tokenize_records, **settings)
        train_dataset, train_summary, *_ = tokenize(
            train_records, tokenizer, template, num_proc=data_args.preprocessing_num_workers
        )
        eval_dataset, eval_summary, *_ = tokenize(eval_records, tokenizer, template)
    for name, summary in (("train", train_summary), ("eval", eval_summary)):
        check_examples_left(name, summary, data_args.max_length, data_args.truncation)

    # 4. Model and trainer; every evaluation also answers held-out records greedily (exact match, token F1).
    model = load_model(model_args, model_path, tokenizer)
    exact_match_records = eval_records[: data_args.exact_match_samples]
    generation_eval = None
    if exact_match_records:
        generation_eval = GenerationEval(
            exact_match_records, template, data_args.max_new_tokens, batch_size=args.per_device_eval_batch_size
        )
    trainer = ScaleTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=make_collator(tokenizer, data_args.packing, data_args.pad_to_multiple_of),
        processing_class=tokenizer,
        generation_eval=generation_eval,
    )
    say = print if trainer.is_world_process_zero() else (lambda *_, **__: None)
    say(f"model: {model_path} ({model.num_parameters() / 1e6:.2f}M parameters)")
    if data_args.dataset is not None:
        say(train_check if not data_args.eval_dataset else f"{train_check}\n{eval_check}")
    batching = batching_of(data_args.packing, args.train_sampling_strategy)
    for name, summary, dataset in (("train", train_summary, train_dataset), ("eval", eval_summary, eval_dataset)):
        lengths = [len(ids) for ids in dataset["input_ids"]]
        say(
            describe_data(
                name, summary, lengths, args.per_device_train_batch_size, batching, data_args.pad_to_multiple_of
            )
        )
    say("one training example as the model sees it (trained-on spans in ⟦ ⟧):")
    say(render_masked_example(tokenizer, train_dataset[0]["input_ids"], train_dataset[0]["labels"]))

    # 5. Evaluate, train, evaluate again: eval loss and held-out greedy exact match.
    def evaluate(stage: str) -> dict:
        metrics = trainer.evaluate(metric_key_prefix=f"eval_{stage}")
        say(f"{stage}: " + ", ".join(f"{k} = {v:.4g}" for k, v in metrics.items() if k.endswith(("loss", "match"))))
        return metrics

    before = evaluate("before")
    train_result = trainer.train()
    after = evaluate("after")

    # 6. Save: model and tokenizer as a normal HF folder, metrics, loss curve.
    trainer.save_model()
    trainer.save_state()
    results = {
        "model": model_path,
        "effective_batch_size": args.effective_batch_size,
        "world_size": args.world_size,
        "train_examples": train_summary.examples,
        "eval_examples": eval_summary.examples,
        "exact_match_records": len(exact_match_records),
        **before,
        **train_result.metrics,
        **after,
    }
    if trainer.is_world_process_zero():
        output_dir = Path(args.output_dir)
        (output_dir / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
        plot_loss_curve(trainer.state.log_history, output_dir / "loss_curve.png")
        plot_learning_rate(trainer.state.log_history, output_dir / "learning_rate.png")
        if exact_match_records:
            say(
                f"held-out exact match: {before['eval_before_exact_match']:.3f} -> "
                f"{after['eval_after_exact_match']:.3f} on {len(exact_match_records)} records never seen in training"
            )
        say(f"saved model, tokenizer, metrics.json, loss_curve.png and learning_rate.png to {output_dir}")
    trainer.accelerator.end_training()  # the process group ends before the interpreter does
    return results


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except HfScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
