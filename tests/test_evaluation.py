import torch

from hf_scale.data.templates import ALPACA
from hf_scale.evaluation import greedy_exact_match
from hf_scale.modeling import load_tokenizer


class ScriptedModel(torch.nn.Module):
    """Answers each prompt with a scripted response, so the expected exact match is known."""

    def __init__(self, tokenizer, responses):
        super().__init__()
        self.tokenizer, self.responses = tokenizer, list(responses)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert not self.training and not do_sample
        assert (attention_mask[:, -1] == 1).all()  # left padding: every prompt ends at the last column
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
