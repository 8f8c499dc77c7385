#!/usr/bin/env python
"""Preference-tune (DPO, IPO, hinge, SimPO, ORPO) a fine-tuned LLaMA-2-class model with hf_scale's PreferenceTrainer.

With no arguments it tunes the tiny model that `hf-scale train` leaves in outputs/tiny-cpu, on generated pairs
(chosen: the right answer; rejected: a wrong one), on any CPU, in about a minute:

    hf-scale train && hf-scale dpo

On GPU nodes, pick a shipped config by name (`hf-scale recipes list`) or a YAML file of your own:

    accelerate launch --config_file recipes/accelerate/1node_4gpu.yaml -m hf_scale.cli dpo \\
        --config llama2_7b_4xa100_zero3_dpo
    torchrun --nproc_per_node 1 -m hf_scale.cli dpo --config llama2_7b_1x4090_qlora_dpo

Every config key is also a flag, and flags win: `--beta 0.05 --loss_type ipo`. `--resume auto` continues from the
newest complete checkpoint in output_dir; precomputed reference log-probs are read back from the cache, not
computed again.
"""

import dataclasses

from transformers import set_seed

from hf_scale.arguments import prepare_run
from hf_scale.data.summary import render_masked_example
from hf_scale.evaluation import GenerationEval
from hf_scale.modeling import ModelArguments, load_model, load_tokenizer
from hf_scale.preference import PreferenceCollator, PreferenceTrainer, ScalePreferenceArguments
from hf_scale.preference.arguments import PreferenceDataArguments
from hf_scale.preference.collator import pad_token_id
from hf_scale.preference.data import prepare_pairs
from hf_scale.recipes.preparation import model_folder, parse_recipe_arguments, run_as_program, write_run_files


def main(argv: list[str]) -> dict:
    # 1. Arguments: the YAML config, then flags on top. Every mistake stops here, before any work.
    model_args, data_args, args = parse_recipe_arguments(
        argv, (ModelArguments, PreferenceDataArguments, ScalePreferenceArguments), "tiny_cpu_dpo", __doc__
    )
    args = prepare_run(args, model_args)

    # 2. Tokenizer and pairs: each record checked, a held-out split, chosen and rejected answers labelled exactly
    #    (their end of turn included) after the same prompt tokens; every pair left out is counted.
    model_path = model_folder(model_args, args)
    tokenizer = load_tokenizer(model_path, trust_remote_code=model_args.trust_remote_code)
    data = prepare_pairs(
        data_args.dataset,
        data_args.eval_dataset,
        data_args.eval_ratio,
        data_args.template,
        tokenizer,
        data_args.max_length,
        data_args.truncation,
        data_args.system_prompt,
        data_args.exact_match_samples,
        args.seed,
    )

    # 3. Policy (and a reference model when reference: model), then the trainer.
    set_seed(args.seed)
    model = load_model(model_args, model_path, tokenizer)
    ref_model = None
    if args.reference == "model":
        ref_args = dataclasses.replace(model_args, lora_r=0, model_name_or_path=args.ref_model_name_or_path)
        ref_model = load_model(ref_args, args.ref_model_name_or_path or model_path, tokenizer)
    generation_eval = None
    if data.generation_records:
        generation_eval = GenerationEval(
            data.generation_records, data.generation_template, data_args.max_new_tokens, args.per_device_eval_batch_size
        )
    trainer = PreferenceTrainer(
        model=model,
        args=args,
        ref_model=ref_model,
        train_dataset=data.train_dataset,
        eval_dataset=data.eval_dataset,
        data_collator=PreferenceCollator(pad_token_id(tokenizer), packing=data_args.packing),
        processing_class=tokenizer,
        generation_eval=generation_eval,
    )
    say = print if trainer.is_world_process_zero() else (lambda *_, **__: None)
    say(f"model: {model_path} ({model.num_parameters() / 1e6:.2f}M parameters)")
    say(f"preference: loss {args.loss_type}, beta {args.beta}, reference {trainer.reference}")
    say(f"train: {data.train_summary}")
    say(f"eval: {data.eval_summary}")
    say("one pair as the model sees it (trained-on spans in ⟦ ⟧), chosen then rejected:")
    for half in ("chosen", "rejected"):
        row = data.train_dataset[0]
        say(render_masked_example(tokenizer, row[f"{half}_input_ids"], row[f"{half}_labels"]))

    # 4. Evaluate, train, evaluate again: held-out reward accuracy and margin (and exact match when asked).
    def report(stage: str, metrics: dict) -> dict:
        shown = ("loss", "rewards/accuracies", "rewards/margins", "exact_match")
        say(f"{stage}: " + ", ".join(f"{k} = {v:.4g}" for k, v in metrics.items() if k.endswith(shown)))
        return metrics

    before = report("before", trainer.evaluate(metric_key_prefix="eval_before"))
    train_result = trainer.train()
    after = report("after", trainer.evaluate_trained(metric_key_prefix="eval_after"))

    # 5. Save: model (or adapters) and tokenizer as a normal HF folder, metrics, loss curve.
    trainer.save_model()
    trainer.save_state()
    results = {
        "model": model_path,
        "reference": trainer.reference,
        "reference_origin": trainer.reference_origin,
        "effective_batch_size": args.effective_batch_size,
        "world_size": args.world_size,
        "train_pairs": len(data.train_dataset),
        "eval_pairs": len(data.eval_dataset),
        **before,
        **train_result.metrics,
        **after,
    }
    if trainer.is_world_process_zero():
        write_run_files(args.output_dir, results, model_args, data_args, args, trainer.state.log_history)
        say(
            f"held-out reward accuracy: {before['eval_before_rewards/accuracies']:.3f} -> "
            f"{after['eval_after_rewards/accuracies']:.3f} on {len(data.eval_dataset)} pairs never seen in training"
        )
        say(f"saved model, tokenizer, metrics.json, run_config.json and loss_curve.png to {args.output_dir}")
    trainer.accelerator.end_training()
    return results


if __name__ == "__main__":
    run_as_program(main)
