"""Searches the preference tuning of an SFT run (full weights, so the reference is precomputed) with
`PreferenceTrainer.hyperparameter_search` over the default preference space, and writes rank 0's study to
<output_dir>/search.json. Launched by tests/preference/test_search.py (alone, under torchrun, or starting parallel
workers); not a test itself. Flags: --model_path, ScalePreferenceArguments' and SearchArguments'."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hf_scale.arguments import prepare_run
from hf_scale.data.templates import get_template
from hf_scale.evaluation import GenerationEval
from hf_scale.hpo import SearchArguments
from hf_scale.hpo.space import preference_hp_space
from hf_scale.preference import PreferenceTrainer, ScalePreferenceArguments, preference_pair, tokenize_preferences
from hf_scale.tiny.tasks import generate_preference_tasks


@dataclass
class WorkerArguments:
    model_path: str


def pairs(tokenizer, records):
    parsed = [preference_pair(record, f"pair {index}") for index, record in enumerate(records)]
    return tokenize_preferences(parsed, tokenizer, get_template("alpaca"), max_length=128)[0]


def main() -> None:
    parser = HfArgumentParser((WorkerArguments, ScalePreferenceArguments, SearchArguments))
    worker, args, search = parser.parse_args_into_dataclasses()
    args = prepare_run(args)
    tokenizer = AutoTokenizer.from_pretrained(worker.model_path)
    train, held_out = generate_preference_tasks()
    # held-out prompts answered greedily at each evaluation: eval_exact_match against the chosen answer
    answers = [{"instruction": r["instruction"], "input": r["input"], "output": r["chosen"]} for r in held_out[:32]]
    trainer = PreferenceTrainer(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(worker.model_path),
        args=args,
        train_dataset=pairs(tokenizer, train[:64]),
        eval_dataset=pairs(tokenizer, held_out[:32]),
        processing_class=tokenizer,
        generation_eval=GenerationEval(answers, get_template("alpaca"), max_new_tokens=8),
    )
    settings = {key: value for key, value in vars(search).items() if key not in ("n_trials", "direction")}
    # rates from one that keeps the SFT answers in 6 steps to ones that unlearn them: something to prune
    best = trainer.hyperparameter_search(
        hp_space=preference_hp_space(learning_rate=(1e-4, 1e-1)), n_trials=search.n_trials, **settings
    )
    if trainer.is_world_process_zero():
        study = trainer.hp_search_study
        trials = [
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "values": list(t.intermediate_values.values()),
            }
            for t in study.trials
        ]
        report = {"best": best._asdict(), "trials": trials, "origin": trainer.reference_origin}
        (Path(args.output_dir) / "search.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    sys.exit(main())
