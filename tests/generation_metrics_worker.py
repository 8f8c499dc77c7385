"""Computes generation_metrics on the tiny model for the records in a JSON file and writes them per rank.

Launched by test_evaluation.py with torchrun; not a test itself.
Usage: MODEL_DIR RECORDS_JSON OUTPUT_DIR BATCH_SIZE MAX_NEW_TOKENS.
Writes OUTPUT_DIR/rank{N}.json: the world size, the metrics and this rank's own responses.
"""

import json
import sys
from pathlib import Path

from accelerate import PartialState
from transformers import AutoModelForCausalLM

from hf_scale.data.templates import ALPACA
from hf_scale.evaluation import generate_responses, generation_metrics
from hf_scale.modeling import load_tokenizer

model_dir, records_file, output_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
batch_size, max_new_tokens = int(sys.argv[4]), int(sys.argv[5])
# cpu=True is what TrainingArguments(use_cpu=True) gives the Trainer: the processes join one gloo group on CPU.
state = PartialState(cpu=True)
records = json.loads(records_file.read_text())
tokenizer = load_tokenizer(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
metrics = generation_metrics(model, tokenizer, records, ALPACA, max_new_tokens, batch_size)
responses = generate_responses(model, tokenizer, records, ALPACA, max_new_tokens, batch_size)
result = {"world_size": state.num_processes, "metrics": metrics, "responses": responses}
(output_dir / f"rank{state.process_index}.json").write_text(json.dumps(result))
