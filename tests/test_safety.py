"""Issue #8 part 5: nothing unsafe is loaded, and secrets stay out of logs.

Weights load through safetensors only unless the user opts in to pickles, and even then torch only unpickles
tensors; code shipped with a model never runs unless asked for by name; YAML goes through the safe loader; no
config value is evaluated; passwords and tokens are masked wherever a URL is logged.
"""

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_scale.arguments import ScaleTrainingArguments
from hf_scale.config import load_yaml_config
from hf_scale.errors import ConfigError
from hf_scale.modeling import ModelArguments, check_model_is_safe, load_model, load_tokenizer
from hf_scale.safety import mask_secrets, mask_url
from tests.helpers import REPO_ROOT

# --- secrets in logs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, masked",
    [
        ("postgresql://user:secret@host/db", "postgresql://user:***@host/db"),
        (
            "postgresql+psycopg2://optuna:s3cr3t@db.example.org:5432/studies",
            "postgresql+psycopg2://optuna:***@db.example.org:5432/studies",
        ),
        ("mysql://user:p@ss:w0rd@host/db", "mysql://user:***@host/db"),  # an unescaped @ and : in the password
        ("redis://:only-a-password@host:6379/0", "redis://:***@host:6379/0"),
        ("https://host/api?token=abc123&page=2", "https://host/api?token=***&page=2"),
        (
            "https://host/x?access_token=abc&api-key=def&sig=ghi&q=ok",
            "https://host/x?access_token=***&api-key=***&sig=***&q=ok",
        ),
        (
            "postgresql://u:pw@host/db?password=pw2&sslmode=require",
            "postgresql://u:***@host/db?password=***&sslmode=require",
        ),
    ],
)
def test_mask_url_hides_passwords_and_tokens(url, masked):
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    "url",
    ["sqlite:///optuna.db", "postgresql://user@host/db", "https://host/x?page=2", "not a url", "", "journal.log"],
)
def test_mask_url_leaves_urls_without_secrets_as_they_are(url):
    assert mask_url(url) == url


def test_mask_secrets_finds_urls_and_hub_tokens_inside_text():
    token = "hf_" + "aB3" * 12
    text = (
        f"could not connect to 'postgresql://optuna:hunter2@db:5432/hpo' (timeout); "
        f"HF_TOKEN={token}; see https://example.org/docs?page=1"
    )
    masked = mask_secrets(text)
    assert "hunter2" not in masked and token not in masked
    assert masked == (
        "could not connect to 'postgresql://optuna:***@db:5432/hpo' (timeout); "
        "HF_TOKEN=hf_***; see https://example.org/docs?page=1"
    )


def test_the_hub_token_never_shows_in_printed_arguments(tmp_path):
    token = "hf_" + "Zq9" * 12
    args = ScaleTrainingArguments(output_dir=str(tmp_path), hub_token=token, report_to="none")
    assert token not in str(args) and token not in args.to_json_string()


# --- pickles and shipped code -----------------------------------------------------------------------------------


class PlantedCode:
    """Unpickling this runs code: it creates `marker`. What a malicious pytorch_model.bin would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('pwned')",)


@pytest.fixture
def planted_pickle_model(tmp_path, tiny_model_dir):
    """A model folder (config, tokenizer) whose only weights are a pickle that runs code when loaded."""
    folder = tmp_path / "planted"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "PWNED"
    weights = load_file(tiny_model_dir / "model.safetensors")
    weights["model.norm.weight"] = PlantedCode(marker)
    torch.save(weights, folder / "pytorch_model.bin")
    # The control: an unsafe load really runs the planted code, so a marker-free result below means something.
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.read_text() == "pwned"
    marker.unlink()
    return folder, marker


def test_a_planted_pickle_is_refused_and_never_run(planted_pickle_model, tmp_path):
    folder, marker = planted_pickle_model
    refused = rf"model_name_or_path: folder {folder} has only pickle weights \(pytorch_model.bin\)"
    with pytest.raises(ConfigError, match=refused):
        ModelArguments(model_name_or_path=str(folder))  # while the config is parsed: step 1
    tokenizer = load_tokenizer(str(folder))
    with pytest.raises(ConfigError, match=refused):
        load_model(ModelArguments(), str(folder), tokenizer)  # a caller that skipped the argument check
    # Opted in: torch still unpickles tensors only, and the planted code is refused, not run.
    with pytest.raises(ConfigError, match=r"pickle weights in .* hold more than tensors and were not loaded"):
        load_model(ModelArguments(allow_pickle_weights=True), str(folder), tokenizer)
    assert not marker.exists()


def test_the_recipe_refuses_a_planted_pickle_before_any_work(planted_pickle_model, tmp_path, hf_scale_cache):
    folder, marker = planted_pickle_model
    from hf_scale.recipes import finetune_llama2 as recipe

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="has only pickle weights"):
        recipe.main(["--model_name_or_path", str(folder), "--output_dir", str(out), "--max_steps", "1"])
    assert not marker.exists() and not out.exists()


def test_pickle_weights_load_when_the_user_opts_in(tmp_path, tiny_model_dir):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(tiny_model_dir / "model.safetensors")
    torch.save(weights, folder / "pytorch_model.bin")
    check_model_is_safe(str(folder), allow_pickle_weights=True)
    model = load_model(ModelArguments(allow_pickle_weights=True), str(folder), load_tokenizer(str(folder)))
    assert torch.equal(model.get_input_embeddings().weight, weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("config_name", ["config.json", "tokenizer_config.json"])
def test_code_shipped_with_a_model_is_not_run(config_name, tmp_path, tiny_model_dir):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "PWNED"
    (folder / "custom_code.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n")
    config = json.loads((folder / config_name).read_text())
    config["auto_map"] = {"AutoConfig": "custom_code.Config", "AutoModelForCausalLM": "custom_code.Model"}
    if config_name == "tokenizer_config.json":
        config["auto_map"] = {"AutoTokenizer": ["custom_code.Tokenizer", None]}
    (folder / config_name).write_text(json.dumps(config))
    refused = rf"{config_name} maps to Python code shipped in the folder \(auto_map\); .*trust_remote_code: true"
    with pytest.raises(ConfigError, match=refused):
        ModelArguments(model_name_or_path=str(folder))
    with pytest.raises(ConfigError, match=refused):
        load_model(ModelArguments(), str(folder), tokenizer=None)
    assert not marker.exists()


def test_yaml_tags_that_build_python_objects_are_refused(tmp_path):
    marker = tmp_path / "PWNED"
    config = tmp_path / "config.yaml"
    config.write_text(f"learning_rate: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_yaml_config(config)
    assert not marker.exists()


# --- the sources ------------------------------------------------------------------------------------------------

SOURCES = sorted(p for folder in ("hf_scale", "recipes", "bench") for p in (REPO_ROOT / folder).rglob("*.py"))


def unsafe_calls(source: str) -> list[str]:
    """Calls that can run code from a file or a config value, as `line: call`."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
        if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            problems.append(f"{node.lineno}: {name}()")
        elif name == "torch.load" and keywords.get("weights_only") != "True":
            problems.append(f"{node.lineno}: torch.load without weights_only=True")
        elif name in ("yaml.load", "yaml.load_all") and keywords.get("Loader") not in ("yaml.SafeLoader", "SafeLoader"):
            problems.append(f"{node.lineno}: {name} without Loader=yaml.SafeLoader")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "pickle.load", "pickle.loads", "dill.load", "dill.loads"):
            problems.append(f"{node.lineno}: {name}")
        for key, unsafe in (("trust_remote_code", "True"), ("weights_only", "False"), ("use_safetensors", "False")):
            if keywords.get(key) == unsafe:
                problems.append(f"{node.lineno}: {name}({key}={unsafe})")
    return problems


def test_the_scan_finds_every_unsafe_call():
    bad = """
torch.load(path)
torch.load(path, weights_only=False)
yaml.load(text)
yaml.load(text, Loader=yaml.Loader)
yaml.unsafe_load(text)
pickle.loads(data)
eval(config["lr"])
exec(code)
AutoModel.from_pretrained(name, trust_remote_code=True)
AutoModel.from_pretrained(name, use_safetensors=False)
"""
    good = "torch.load(p, weights_only=True)\nyaml.safe_load(t)\nyaml.load(t, Loader=yaml.SafeLoader)\nmodel.eval()\n"
    assert len(unsafe_calls(bad)) == 11  # torch.load(weights_only=False) counts twice
    assert unsafe_calls(good) == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO_ROOT)) for p in SOURCES])
def test_no_unsafe_loading_in_the_sources(path):
    assert unsafe_calls(path.read_text(encoding="utf-8")) == []
