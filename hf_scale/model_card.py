"""The README.md model card of an exported run: YAML front matter as on the hub, what was trained (run_config.json),
how well (metrics.json), and Python that loads it and answers through its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from hf_scale.data.loading import looks_like_local_path

# The message the model card's loading example sends (tests run that example as written).
CARD_EXAMPLE_MESSAGE = "What is 417 plus one?"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _set(value) -> object:
    """A run_config.json value, None for the "None" that `to_sanitized_dict` writes."""
    return None if value in (None, "None", "", "[]") else value


def training_summary(run_config: dict, metrics: dict | None, state: dict | None) -> list[str]:
    """The model card's training lines, from run_config.json (with metrics.json and trainer_state.json)."""
    model, data, training = run_config.get("model", {}), run_config.get("data", {}), run_config.get("training", {})
    metrics = metrics or {}
    lines = [f"- model: {_set(model.get('model_name_or_path')) or metrics.get('model') or 'the embedded tiny LLaMA'}"]
    datasets = _set(data.get("datasets")) or _set(data.get("dataset")) or "the embedded generated tasks"
    lines.append(
        f"- data: {datasets} ({data.get('data_format', '?')} format, max_length {data.get('max_length', '?')}, "
        f"packing {'on' if data.get('packing') else 'off'})"
    )
    lines.append(f"- prompt template: {data.get('template', '?')}")
    if _set(data.get("system_prompt")):
        lines.append(f"- system prompt: {data['system_prompt']!r}")
    lr = training.get("learning_rate")
    lines.append(
        f"- learning rate: {lr} ({training.get('lr_scheduler_type', '?')} schedule, warmup "
        f"{training.get('warmup_steps', '?')}, weight decay {training.get('weight_decay', '?')})"
    )
    if "effective_batch_size" in metrics:
        lines.append(
            f"- effective batch: {metrics['effective_batch_size']} ({training.get('per_device_train_batch_size')} "
            f"per device x {metrics.get('world_size', '?')} process(es) x "
            f"{training.get('gradient_accumulation_steps')} accumulation steps)"
        )
    else:
        lines.append(
            f"- batch: {training.get('per_device_train_batch_size')} per device x "
            f"{training.get('gradient_accumulation_steps')} accumulation steps"
        )
    max_steps = training.get("max_steps")
    planned = (
        f"max_steps {max_steps}" if max_steps and int(max_steps) > 0 else f"{training.get('num_train_epochs')} epochs"
    )
    done = f"{state['global_step']} steps, {state.get('epoch') or 0:.3g} epochs; " if state else ""
    lines.append(f"- training: {done}{planned}")
    if int(model.get("lora_r") or 0) > 0:
        lines.append(
            f"- LoRA: r {model['lora_r']}, alpha {model.get('lora_alpha')}, dropout {model.get('lora_dropout')}, "
            f"target modules {', '.join(model.get('lora_target_modules') or [])}"
        )
    else:
        lines.append("- full fine-tuning (every weight trained)")
    precision = (
        "bf16 mixed precision" if training.get("bf16") else "fp16 mixed precision" if training.get("fp16") else "fp32"
    )
    lines.append(f"- precision: {precision}; model loaded with dtype {model.get('dtype', 'auto')}")
    zero = _set(training.get("zero_preset"))
    distributed = (
        f"DeepSpeed preset {zero}" if zero else "custom DeepSpeed config" if _set(training.get("deepspeed")) else "none"
    )
    lines.append(f"- ZeRO preset: {distributed}; seed {training.get('seed')}")
    return lines


def metrics_summary(metrics: dict) -> list[str]:
    """The model card's metric lines: eval loss and held-out exact match before and after training."""
    lines = []
    for name, key in (("eval loss", "loss"), ("exact match", "exact_match"), ("token F1", "token_f1")):
        before, after = metrics.get(f"eval_before_{key}"), metrics.get(f"eval_after_{key}")
        if before is None and after is None:
            continue
        fmt = (lambda v: f"{v:.4g}") if key == "loss" else (lambda v: f"{v:.3f}")
        shown = " -> ".join(fmt(v) if v is not None else "?" for v in (before, after))
        lines.append(f"- {name} (before -> after training): {shown}")
    if metrics.get("exact_match_records"):
        lines.append(f"- exact match and token F1: greedy answers to {metrics['exact_match_records']} held-out records")
    if "train_loss" in metrics:
        lines.append(f"- mean training loss: {metrics['train_loss']:.4g}")
    return lines


def loading_example(out: Path, adapter: bool) -> str:
    """Python that loads OUT and answers one message through the chat template."""
    if adapter:
        load = (
            "from peft import AutoPeftModelForCausalLM\n"
            "from transformers import AutoTokenizer\n\n"
            "# The base model named in adapter_config.json is loaded too.\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{out}")\n'
        )
    else:
        load = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{out}")\n'
        )
    return (
        f"{load}"
        f'tokenizer = AutoTokenizer.from_pretrained("{out}")\n'
        f'messages = [{{"role": "user", "content": "{CARD_EXAMPLE_MESSAGE}"}}]\n'
        "# The chat template writes the prompt as in training, BOS included.\n"
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, "
        'return_tensors="pt")\n'
        "output = model.generate(**inputs, max_new_tokens=64, do_sample=False)\n"
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))\n'
    )


def model_card(
    run_dir: Path, out: Path, *, adapter: bool, merged: bool, base: str | None, dtype: str, chat_template: str | None
) -> str:
    """README.md: YAML front matter as on the hub, then what was trained, how well, and how to load it."""
    run_config = read_json(run_dir / "run_config.json")
    metrics = read_json(run_dir / "metrics.json")
    state = read_json(run_dir / "trainer_state.json")
    hub_base = base if base and not looks_like_local_path(base) and not Path(base).exists() else None
    front = ["---", f"library_name: {'peft' if adapter else 'transformers'}", "pipeline_tag: text-generation"]
    if hub_base:
        front.append(f"base_model: {hub_base}")
    tags = ["hf-scale", "instruction-tuned", *(["lora"] if adapter or merged else [])]
    front += ["tags:", *(f"- {tag}" for tag in tags), "---", ""]
    what = (
        "a LoRA adapter (not merged: loading it needs peft and the base model)"
        if adapter
        else "a LoRA fine-tune merged into its base model"
        if merged
        else "a fine-tuned model"
    )
    lines = [
        f"# {out.name}",
        "",
        f"Exported by `hf-scale export` from `{run_dir}`: {what}" + ("." if adapter else f", weights in {dtype}."),
    ]
    if base:
        lines.append(f"Base model: `{base}`.")
    lines += ["", "## Training", ""]
    if run_config:
        lines += training_summary(run_config, metrics, state)
    else:
        step = f" (a checkpoint at step {state['global_step']})" if state and "global_step" in state else ""
        lines.append(f"No run_config.json in `{run_dir}`{step}: the training configuration is not known.")
    lines += ["", "## Evaluation", ""]
    shown = metrics_summary(metrics) if metrics else []
    lines += shown or [f"No metrics.json in `{run_dir}` (a checkpoint folder has none): no evaluation to report."]
    lines += ["", "## Use", ""]
    if adapter:
        lines += [f"Needs `peft` and the base model `{base}` (export with `--merge-lora` for a plain model).", ""]
    else:
        lines += ["Plain transformers, nothing else needed:", ""]
    lines += ["```python", loading_example(out, adapter).rstrip(), "```", ""]
    if chat_template:
        lines += [
            "The chat template (`chat_template.jinja`) writes prompts as they were written in training; "
            "`apply_chat_template` uses it:",
            "",
            "```jinja",
            chat_template.strip(),
            "```",
        ]
    else:
        lines.append("The tokenizer has no chat template: write prompts as the run's template did.")
    return "\n".join(front + lines) + "\n"
