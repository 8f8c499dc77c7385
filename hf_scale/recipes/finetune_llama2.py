#!/usr/bin/env python
"""Fine-tune a LLaMA-2-class model on Alpaca-style instruction data with hf_scale's ScaleTrainer.

With no arguments it trains the embedded tiny LLaMA on generated tasks, on any CPU, in about a minute:

    hf-scale train
    accelerate launch recipes/finetune_llama2.py                    # from a clone: the same recipe

On GPU nodes, pick a shipped config by name (`hf-scale recipes list`) or a YAML file of your own, and an
accelerate config for the process layout:

    accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml -m hf_scale.cli train \\
        --config llama2_7b_4xa100_zero1
    torchrun --nproc_per_node 8 recipes/finetune_llama2.py --config llama2_13b_8xa100_zero2
    deepspeed --num_gpus 8 recipes/finetune_llama2.py --config llama2_13b_8xa100_zero2

Every config key is also a flag, and flags win: `--learning_rate 3e-5 --output_dir runs/try2`.
`--resume auto` continues from the newest complete checkpoint in output_dir, if there is one.
"""

from transformers import set_seed

from hf_scale.arguments import ScaleTrainingArguments, prepare_run
from hf_scale.data.arguments import DataArguments
from hf_scale.data.batching import make_collator
from hf_scale.data.mixture import describe_draws
from hf_scale.data.summary import batching_of, describe_batching, example_lengths, render_masked_example
from hf_scale.data.tokenize import responses_cut_warning
from hf_scale.evaluation import GenerationEval
from hf_scale.modeling import ModelArguments, load_model
from hf_scale.recipes.preparation import parse_recipe_arguments, prepare_data, run_as_program, write_run_files
from hf_scale.trainer import ScaleTrainer


def main(argv: list[str]) -> dict:
    # 1. Arguments: the YAML config, then flags on top. Every mistake stops here, before any work.
    model_args, data_args, args = parse_recipe_arguments(
        argv, (ModelArguments, DataArguments, ScaleTrainingArguments), "tiny_cpu", __doc__
    )
    args = prepare_run(
        args, model_args
    )  # zero_preset auto planned, output_dir writable, the checkpoint to resume there

    # 2. Data and tokenizer: Alpaca records or conversations, each one checked, a held-out split; labels on the
    #    responses and their end of turn only; several datasets mixed by weight.
    data = prepare_data(model_args, data_args, args)
    model_path, tokenizer, train_dataset = data.model_path, data.tokenizer, data.train_dataset

    # 3. Model and trainer; every evaluation also answers held-out records greedily (exact match, token F1). Seeded
    #    first: new weights (LoRA's A matrices) follow `seed`, not what the process drew before.
    set_seed(args.seed)
    model = load_model(model_args, model_path, tokenizer)
    generation_eval = None
    if data.held_out:
        generation_eval = GenerationEval(
            data.held_out, data.template, data_args.max_new_tokens, batch_size=args.per_device_eval_batch_size
        )
    trainer = ScaleTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=data.eval_dataset,
        data_collator=make_collator(tokenizer, data_args.packing, data_args.pad_to_multiple_of),
        processing_class=tokenizer,
        generation_eval=generation_eval,
    )
    say = print if trainer.is_world_process_zero() else (lambda *_, **__: None)
    say(f"model: {model_path} ({model.num_parameters() / 1e6:.2f}M parameters)")
    batching = batching_of(data_args.packing, args.train_sampling_strategy)
    padding = {
        name: describe_batching(
            example_lengths(dataset),
            args.per_device_train_batch_size,
            batching,
            data_args.pad_to_multiple_of,
        )
        for name, dataset in (("train", train_dataset), ("eval", data.eval_dataset))
    }
    mixed = len(data.sources) > 1
    for source in data.sources:
        for record_check in source.record_checks:
            say(record_check)
        of = f" from {source.source.name}" if mixed else ""
        # Where each process's examples came from: the first process tokenizes, the others (and a relaunch) read
        # what it left in the cache.
        origin = "read from the cache" if source.reused else "tokenized"
        if args.world_size > 1:
            print(f"process {args.process_index}: examples of {source.source.name} {origin}")
        elif source.reused:
            say(f"examples of {source.source.name} {origin}")
        for name, summary in (("train", source.train_summary), ("eval", source.eval_summary)):
            say(f"{name}{of}: {summary}" + ("" if mixed else f"; {padding[name]}"))
        if warning := responses_cut_warning("train", source.train_summary, data_args.max_length, source.source.name):
            say(f"warning: {warning}")
    if mixed:
        examples = [len(source.train_dataset) for source in data.sources]
        names = [source.source.name for source in data.sources]
        say(describe_draws(names, examples, data.drawn, data_args.mixture, args.seed))
        say(f"train: {len(train_dataset)} examples; {padding['train']}")
        say(f"eval: {len(data.eval_dataset)} examples; {padding['eval']}")
    say("one training example as the model sees it (trained-on spans in ⟦ ⟧):")
    say(render_masked_example(tokenizer, train_dataset[0]["input_ids"], train_dataset[0]["labels"]))

    # 4. Evaluate, train, evaluate again: eval loss and held-out greedy exact match (the "after" figures are training's
    #    own last evaluation when it evaluated the last step).
    def report(stage: str, metrics: dict) -> dict:
        say(f"{stage}: " + ", ".join(f"{k} = {v:.4g}" for k, v in metrics.items() if k.endswith(("loss", "match"))))
        return metrics

    before = report("before", trainer.evaluate(metric_key_prefix="eval_before"))
    train_result = trainer.train()
    after = report("after", trainer.evaluate_trained(metric_key_prefix="eval_after"))

    # 5. Save: model and tokenizer as a normal HF folder, metrics, loss curve.
    trainer.save_model()
    trainer.save_state()
    results = {
        "model": model_path,
        "effective_batch_size": args.effective_batch_size,
        "world_size": args.world_size,
        "train_examples": len(train_dataset),
        "eval_examples": len(data.eval_dataset),
        "exact_match_records": len(data.held_out),
        **before,
        **train_result.metrics,
        **after,
    }
    if trainer.is_world_process_zero():
        write_run_files(args.output_dir, results, model_args, data_args, args, trainer.state.log_history)
        if data.held_out:
            say(
                f"held-out exact match: {before['eval_before_exact_match']:.3f} -> "
                f"{after['eval_after_exact_match']:.3f} on {len(data.held_out)} records never seen in training"
            )
        say(
            "saved model, tokenizer, metrics.json, run_config.json, loss_curve.png and learning_rate.png to "
            f"{args.output_dir}"
        )
    trainer.accelerator.end_training()  # the process group ends before the interpreter does
    return results


if __name__ == "__main__":
    run_as_program(main)
