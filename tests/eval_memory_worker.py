"""Evaluates the tiny model on N held-out records; prints the peak RSS during evaluation above the RSS before it.

Launched by test_evaluation.py in a fresh process per measurement; not a test itself. Usage: MODEL_DIR METHOD N,
METHOD being `generation` (hf_scale's generation_metrics) or `predict` (the stock Trainer.predict with a
compute_metrics, which keeps every logit until the end: the contrast that shows the measurement can fail).

The kernel's peak RSS (VmHWM) is reset just before evaluating (Linux: "5" into /proc/self/clear_refs). The
lifetime peak, `ru_maxrss`, is set while loading and hid the evaluation's peak entirely (growth 0.0) under pytest.
"""

import json
import re
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from hf_scale.data.templates import ALPACA
from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
from hf_scale.evaluation import generation_metrics
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import generate_tasks

BATCH_SIZE = 16
MAX_NEW_TOKENS = 4


def memory_mib(field: str) -> float:
    """`VmRSS` (resident now) or `VmHWM` (peak resident since start or the last reset) from /proc, in MiB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def token_accuracy(prediction) -> dict[str, float]:
    predicted = prediction.predictions.argmax(-1)[:, :-1]
    labels = prediction.label_ids[:, 1:]
    scored = labels != IGNORE_INDEX
    return {"token_accuracy": float(np.mean(predicted[scored] == labels[scored]))}


def stock_predict(model, tokenizer, records, output_dir: str):
    """Everything the stock loop needs, built before measuring; returns the call that evaluates."""
    dataset, _ = tokenize_records(records, tokenizer, ALPACA, max_length=128)
    args = TrainingArguments(
        output_dir=output_dir, per_device_eval_batch_size=BATCH_SIZE, report_to="none", use_cpu=True, disable_tqdm=True
    )
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        compute_metrics=token_accuracy,
    )
    return lambda: trainer.predict(dataset).metrics


model_dir, method, n_records = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = load_tokenizer(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
records = generate_tasks()[1][:n_records]
assert len(records) == n_records, f"the held-out set has only {len(records)} records"
with tempfile.TemporaryDirectory() as output_dir:
    if method == "generation":
        evaluate_once = partial(
            generation_metrics, model, tokenizer, records, ALPACA, max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH_SIZE
        )
    else:
        evaluate_once = stock_predict(model, tokenizer, records, output_dir)
    reset_peak_rss()
    before = memory_mib("VmRSS")
    evaluate_once()
    growth = memory_mib("VmHWM") - before
print(json.dumps({"method": method, "records": n_records, "rss_before_mib": before, "peak_growth_mib": growth}))
