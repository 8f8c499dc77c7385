import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_scale.metrics
from hf_scale.data.batching import make_collator
from hf_scale.data.templates import ALPACA, get_template
from hf_scale.data.tokenize import prompt_ids
from hf_scale.errors import ConfigError
from hf_scale.evaluation import generate_responses, generation_metrics, greedy_exact_match
from hf_scale.metrics import load_metric
from hf_scale.modeling import load_tokenizer
from hf_scale.tiny import generate_tasks
from tests.data.chat_tokenizers import chatml_tokenizer
from tests.helpers import assert_succeeded, run_command, torchrun


class ScriptedModel(torch.nn.Module):
    """Answers each prompt with a scripted response, so the expected exact match is known."""

    def __init__(self, tokenizer, responses):
        super().__init__()
        self.tokenizer, self.responses = tokenizer, list(responses)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.attention_masks = []  # of every generate call, to check how the prompts were padded

    @property
    def device(self):
        return self.anchor.device

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id, **kwargs):
        assert not self.training and not do_sample
        # Token ids only: nothing that keeps scores or logits.
        assert kwargs["output_scores"] is False and kwargs["return_dict_in_generate"] is False
        assert (attention_mask[:, -1] == 1).all()  # left padding: every prompt ends at the last column
        self.attention_masks.append(attention_mask)
        rows = []
        for _ in range(len(input_ids)):
            ids = self.tokenizer(self.responses.pop(0), add_special_tokens=False)["input_ids"]
            ids = [*ids, self.tokenizer.eos_token_id][:max_new_tokens]
            rows.append(ids + [pad_token_id] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_exact_match_counts_exact_answers_only(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = [
        {"instruction": "Add one to the number.", "input": str(n), "output": str(n + 1)} for n in range(100, 110)
    ]
    # Right, right with spaces around it (stripped: still right), wrong, right but too long: 5 of 10 right.
    responses = [
        r["output"] if i % 2 == 0 else (r["output"] + "0" if i % 4 == 1 else "999") for i, r in enumerate(records)
    ]
    responses[0] = f" {records[0]['output']} "
    model = ScriptedModel(tokenizer, responses)
    model.train()
    score = greedy_exact_match(model, tokenizer, records, ALPACA, max_new_tokens=6, batch_size=4)
    assert score == 0.5
    assert model.training  # the caller's mode is restored


@pytest.mark.parametrize("side", ["right", "left"])
def test_generation_pads_on_the_left_and_leaves_the_tokenizers_side_to_training(tiny_model_dir, side):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.padding_side = side
    records = RECORDS_OF_TWO_LENGTHS
    model = ScriptedModel(tokenizer, [r["output"] for r in records])
    assert generate_responses(model, tokenizer, records, ALPACA, max_new_tokens=4) == ["42", "10"]
    [mask] = model.attention_masks
    assert mask[:, 0].tolist() == [1, 0]  # the shorter prompt is padded, on the left (ScriptedModel checks the end)
    assert tokenizer.padding_side == side  # generation chose left for its own batch only
    # and training batches made afterwards still pad on the right
    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [5], "labels": [5]}]
    batch = make_collator(tokenizer, packing=False, pad_to_multiple_of=None)(features)
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"][1].tolist() == [5, -100, -100]


RECORDS_OF_TWO_LENGTHS = [
    {"instruction": "Add one to the number.", "input": "41", "output": "42"},
    {"instruction": "What number comes after 9?", "input": "", "output": "10"},
]


class ForceScripts(LogitsProcessor):
    """Makes greedy generation write `scripts[row]`, then repeat its last token: a model that does not stop itself."""

    def __init__(self, scripts: list[list[int]], prompt_width: int):
        self.scripts, self.prompt_width = scripts, prompt_width

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, float("-inf"))
        for row, script in enumerate(self.scripts):
            forced[row, script[min(step, len(script) - 1)]] = 0
        return forced


def test_greedy_generation_stops_at_the_chat_templates_end_of_turn(tiny_model_dir):
    # ChatML: a turn ends with <|im_end|>, EOS is <|endoftext|>; the model says its answer, closes its turn, and
    # (as any model would, unstopped) goes on writing.
    tokenizer = chatml_tokenizer(tiny_model_dir)
    tokenizer.pad_token = tokenizer.unk_token
    template = get_template("chat_template", tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.resize_token_embeddings(len(tokenizer))
    records = RECORDS_OF_TWO_LENGTHS
    scripts = [tokenizer(r["output"] + "<|im_end|>99", add_special_tokens=False)["input_ids"] for r in records]
    assert scripts[0][2] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    real_generate = model.generate

    def scripted_generate(**kwargs):
        processors = LogitsProcessorList([ForceScripts(scripts, kwargs["input_ids"].shape[1])])
        return real_generate(**kwargs, logits_processor=processors)

    model.generate = scripted_generate
    texts = generate_responses(model, tokenizer, records, template, max_new_tokens=8, batch_size=2)
    assert texts == ["42", "10"]  # not "4299999": generation stops where the chat format ends the turn
    assert greedy_exact_match(model, tokenizer, records, template, max_new_tokens=8, batch_size=2) == 1.0


def plain_greedy_loop(model, tokenizer, records, max_new_tokens: int) -> list[str]:
    """The reference: one unpadded prompt at a time, greedy, the new tokens decoded."""
    texts = []
    for record in records:
        ids = torch.tensor([prompt_ids(tokenizer, ALPACA.format_prompt(record["instruction"], record["input"]))])
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def half_answered(records, answers: list[str]) -> list[dict[str, str]]:
    """`records` whose expected output is `answers[i]` for even i and something else for odd i."""
    return [
        {**record, "output": answer if i % 2 == 0 else answer + " not this"}
        for i, (record, answer) in enumerate(zip(records, answers, strict=True))
    ]


def test_generation_metrics_equal_a_plain_generate_loop(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    # English and Chinese wordings, with and without input: prompts of many lengths, so batches are padded.
    records = generate_tasks()[1][:22]
    assert len({len(prompt_ids(tokenizer, ALPACA.format_prompt(r["instruction"], r["input"]))) for r in records}) > 3
    # The untrained model's own greedy answers are the expected output of every other record: exact match 0.5.
    loop_texts = plain_greedy_loop(model, tokenizer, records, max_new_tokens=8)
    assert len(set(loop_texts)) > 5  # the answers depend on the prompt: a mixed-up order would show
    records = half_answered(records, loop_texts)
    loop_exact_match = sum(t.strip() == r["output"].strip() for t, r in zip(loop_texts, records, strict=True)) / 22

    batched_texts = generate_responses(model, tokenizer, records, ALPACA, max_new_tokens=8, batch_size=5)
    metrics = generation_metrics(model, tokenizer, records, ALPACA, max_new_tokens=8, batch_size=5)

    assert batched_texts == loop_texts
    assert metrics["exact_match"] == loop_exact_match == 0.5
    assert greedy_exact_match(model, tokenizer, records, ALPACA, max_new_tokens=8, batch_size=5) == 0.5
    references = [r["output"] for r in records]
    expected_f1 = load_metric("token_f1").compute(predictions=loop_texts, references=references)["token_f1"]
    assert metrics["token_f1"] == pytest.approx(expected_f1)
    assert 0.5 < metrics["token_f1"] < 1  # the wrong half misses only the reference's 'not this'


def test_exact_match_module_strips_and_nothing_else():
    metric = load_metric("exact_match")
    predictions = [" 101 \n", "102", "Paris", "a  b"]
    references = ["101", "103", "paris", "a b"]  # right; wrong; case counts; inner spaces count
    assert metric.compute(predictions=predictions, references=references) == {"exact_match": 0.25}


@pytest.mark.parametrize(
    ("prediction", "reference", "f1"),
    [
        ("the cat sat", "the cat sat on the mat", 2 * 1 * 0.5 / 1.5),  # P 3/3, R 3/6
        ("a a b", "a b b", 2 / 3),  # shared tokens count with multiplicity: a once, b once
        ("我爱北京", "我爱上海", 0.5),  # per CJK character: 我 爱 shared of 4 each; by whitespace it would be 0
        ("答案是 42。", "答案是42。", 1.0),  # 答 案 是 42 。 both ways
        ("Paris", "paris", 0.0),  # not lower-cased, as exact match
        ("", "", 1.0),
        ("", "101", 0.0),
    ],
)
def test_token_f1_by_hand(prediction, reference, f1):
    assert load_metric("token_f1").compute(predictions=[prediction], references=[reference]) == {
        "token_f1": pytest.approx(f1)
    }


def test_token_f1_is_the_mean_over_pairs():
    predictions, references = ["the cat sat", "x", "我爱北京"], ["the cat", "y", "我爱上海"]
    result = load_metric("token_f1").compute(predictions=predictions, references=references)
    assert result["token_f1"] == pytest.approx((0.8 + 0.0 + 0.5) / 3)  # P 2/3, R 1: F1 0.8


def test_unknown_metric_names_the_known_ones():
    with pytest.raises(ConfigError, match="'bleu'.*exact_match, token_f1"):
        load_metric("bleu")
    with pytest.raises(ConfigError, match="rouge"):
        generation_metrics(None, None, [{"instruction": "i", "input": "", "output": "o"}], ALPACA, metrics=["rouge"])


@pytest.mark.slow  # about 10 s of CPU to import evaluate in a fresh process; over 30 s on a busy machine
def test_metric_modules_load_offline_by_path_from_the_package(tmp_path):
    # A fresh process, offline, with an empty module cache: evaluate.load reads the files the package ships.
    script = (
        "import sys, evaluate\n"
        "for path in sys.argv[1:]:\n"
        "    print(evaluate.load(path).compute(predictions=['42 43'], references=['42']))\n"
    )
    package_dir = Path(hf_scale.metrics.__file__).parent
    paths = [str(package_dir / "exact_match.py"), str(package_dir / "token_f1.py")]
    result = run_command(
        [sys.executable, "-c", script, *paths],
        timeout=120,
        HF_HUB_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        HF_HOME=str(tmp_path / "hf_home"),
    )
    assert_succeeded(result, result.stderr[-3000:])
    assert result.stdout.splitlines() == ["{'exact_match': 0.0}", f"{{'token_f1': {2 * 0.5 / 1.5}}}"]


def peak_growth(model_dir: Path, method: str, n_records: int) -> float:
    """Peak RSS growth (MiB) of one evaluation in a fresh process; see tests/eval_memory_worker.py."""
    result = run_command(
        [sys.executable, "tests/eval_memory_worker.py", str(model_dir), method, str(n_records)], timeout=300
    )
    assert_succeeded(result, result.stderr[-3000:])
    return json.loads(result.stdout.splitlines()[-1])["peak_growth_mib"]


@pytest.mark.slow
def test_generation_memory_does_not_grow_with_the_eval_set(tiny_model_dir):
    # One fresh process per measurement, two at a time (each measures only its own peak). 12x the records may add
    # noise, not a share of 12x the memory: 256 records' logits alone are about 50 MiB here.
    runs = [(method, n) for method in ("generation", "predict") for n in (32, 384)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        growth = dict(zip(runs, pool.map(lambda run: peak_growth(tiny_model_dir, *run), runs), strict=True))
    print(growth)

    def grows(method: str) -> bool:
        return growth[method, 384] >= 1.5 * growth[method, 32] + 20

    assert not grows("generation"), growth
    # The contrast that shows the measurement can fail: the stock loop keeps every logit of the set.
    assert grows("predict"), growth


@pytest.mark.slow
def test_two_ranks_give_the_one_rank_metrics(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # 13 records: rank 0 gets 7, rank 1 gets 6 and, with batches of 3, one dummy batch it does not count.
    records = generate_tasks()[1][:13]
    answers = generate_responses(model, tokenizer, records, ALPACA, max_new_tokens=6, batch_size=3)
    records = half_answered(records, answers)
    one_rank = generation_metrics(model, tokenizer, records, ALPACA, max_new_tokens=6, batch_size=3)
    assert one_rank["exact_match"] == 7 / 13
    records_file = tmp_path / "records.json"
    records_file.write_text(json.dumps(records))

    worker = "tests/generation_metrics_worker.py"
    result = run_command(torchrun(worker, str(tiny_model_dir), str(records_file), str(tmp_path), "3", "6"), timeout=300)

    assert_succeeded(result, result.stderr[-3000:])
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [len(r["responses"]) for r in ranks] == [7, 6]
    assert ranks[0]["responses"] + ranks[1]["responses"] == answers
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == one_rank


def test_evaluate_reports_generation_metrics_equal_to_a_plain_loop(tiny_model_dir, tmp_path):
    from transformers import DataCollatorForSeq2Seq

    from hf_scale.arguments import ScaleTrainingArguments
    from hf_scale.data.tokenize import IGNORE_INDEX, tokenize_records
    from hf_scale.evaluation import GenerationEval
    from hf_scale.trainer import ScaleTrainer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = generate_tasks()[1][:12]
    records = half_answered(records, plain_greedy_loop(model, tokenizer, records, max_new_tokens=8))
    trainer = ScaleTrainer(
        model=model,
        args=ScaleTrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_eval_batch_size=4),
        eval_dataset=tokenize_records(records, tokenizer, ALPACA, max_length=128)[0],
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX),
        processing_class=tokenizer,
        generation_eval=GenerationEval(records, ALPACA, max_new_tokens=8, batch_size=5),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_exact_match"] == 0.5  # what the plain loop gives, by construction of the records
    assert 0.5 < metrics["eval_token_f1"] < 1 and "eval_loss" in metrics
    assert trainer.evaluate(metric_key_prefix="eval_after")["eval_after_exact_match"] == 0.5
