"""Read a recipe's arguments from a YAML file (`--config FILE` or a shipped config's name) with flags on top.

The YAML keys are the dataclass field names, exactly as the flags are. Values are turned into flags and
parsed by `HfArgumentParser` once, so a YAML value and a flag go through the same type checks (YAML 1.1
reads `2e-5` as a string; here it still becomes the float 2e-05). Every mistake is one `ConfigError` that
names the key and where it came from, raised before any work starts.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from hf_scale.errors import ConfigError


class _RaisingParser(HfArgumentParser):
    """argparse prints and exits on a bad value; here a bad value is a `ConfigError` naming where it came from."""

    def __init__(self, dataclass_types, cli_args: list[str], config_path: str | None):
        super().__init__(dataclass_types, allow_abbrev=False)  # --learning_rat must not pass
        self.cli_args, self.config_path = cli_args, config_path

    def error(self, message: str):
        raise ConfigError(_place(message, self.cli_args, self.config_path))


# The configs shipped in the package, found by name: `--config llama2_7b_4xa100_zero1`.
SHIPPED_CONFIGS = Path(__file__).parent / "recipes" / "configs"


def shipped_configs() -> list[str]:
    """The names of the shipped configs."""
    return sorted(path.stem for path in SHIPPED_CONFIGS.glob("*.yaml"))


def config_file(name_or_path: str | Path) -> Path:
    """The config file at `name_or_path`, else the shipped config of that name; else a `ConfigError`."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    raise ConfigError(f"config file not found: {path} (nor a shipped config: {', '.join(shipped_configs())})")


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (or a shipped config named so); one that is not a mapping is an error."""
    path = config_file(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of key: value, not a {type(data).__name__}")
    return data


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    config, rest = None, []
    items = iter(argv)
    for item in items:
        if item == "--config":
            config = next(items, None)
            if config is None:
                raise ConfigError("--config needs a file path")
        elif item.startswith("--config="):
            config = item.split("=", 1)[1]
        else:
            rest.append(item)
    return config, rest


def _flags_for(key: str, value: Any, action, source: str) -> list[str]:
    flag = f"--{key}"
    if isinstance(value, bool):
        return [flag, str(value).lower()]
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return [flag, json.dumps(value)]  # a list of mappings (`datasets`) travels as one JSON value
    if isinstance(value, (list, tuple)):
        if action.nargs not in ("+", "*"):
            raise ConfigError(f"{source}: key {key!r} takes one value, got a list {value!r}")
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _unknown_key_error(key: str, known: list[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{source}: unknown key {key!r}{hint}")


def parse_config(parser: HfArgumentParser, argv: list[str]) -> tuple:
    """Parse `argv` (`--config FILE` plus flags) into `parser`'s dataclasses; flags override the file."""
    values = check_config(parser, argv)
    # argparse has converted and checked every value's type by now (`check_config`): what fails below is a
    # dataclass's `__post_init__`. Only the errors its checks raise on purpose are the user's; any other exception
    # (AttributeError, KeyError, TypeError, ...) is a bug in that code and keeps its traceback. Where transformers
    # fails with those on a malformed nested config (deepspeed, fsdp_config, accelerator_config),
    # `ScaleTrainingArguments` raises a `ConfigError` naming the key.
    try:
        return parser.parse_dict(values)
    except ConfigError:
        raise
    except ValueError as error:  # TrainingArguments' own checks of value combinations
        raise ConfigError(f"invalid arguments: {error}") from None
    except OSError as error:  # plain TrainingArguments opening a path to no file (fsdp_config, accelerator_config)
        raise ConfigError(f"invalid arguments: {type(error).__name__}: {error}") from None


def check_config(parser: HfArgumentParser, argv: list[str]) -> dict[str, Any]:
    """Check keys and value types as `parse_config` does, without building the dataclasses.

    For configs meant for another machine: building `TrainingArguments` with `bf16: true` or a DeepSpeed
    config fails on a CPU-only machine. Returns the parsed values by key.
    """
    config_path, cli_args = _split_config_flag(argv)
    actions = _actions(parser)
    raising = _RaisingParser(parser.dataclass_types, cli_args, config_path)
    # The config file's values as flags, then the command line's: one list for argparse, last one wins.
    file_args: list[str] = []
    if config_path is not None:
        source = f"config file {config_path}"
        for key, value in load_yaml_config(config_path).items():
            if key not in actions:
                raise _unknown_key_error(str(key), sorted(actions), source)
            if key in _flag_keys(cli_args):
                continue  # the flag wins; the file's value is not even checked
            if value is None:
                if not _takes_none(parser, key):  # else a check such as `lora_r < 0` fails on None, far away
                    raise ConfigError(f"{source}: key {key!r} cannot be null (leave the key out for its default)")
                raising.set_defaults(**{key: None})  # null means None, which no flag can say
            else:
                file_args += _flags_for(key, value, actions[key], source)
    namespace, remaining = raising.parse_known_args(file_args + cli_args)
    _refuse_leftovers(remaining, raising)
    return vars(namespace)


def _takes_none(parser: HfArgumentParser, key: str) -> bool:
    """Whether the dataclass field behind `key` is typed to take None (`int | None`)."""
    for dataclass_type in parser.dataclass_types:
        hints = typing.get_type_hints(dataclass_type)
        if key in hints:
            return type(None) in typing.get_args(hints[key])
    return True


def _actions(parser: HfArgumentParser) -> dict[str, Any]:
    return {action.dest: action for action in parser._actions if action.option_strings}


def _refuse_leftovers(remaining: list[str], parser: HfArgumentParser) -> None:
    if not remaining:
        return
    unknown = next((item for item in remaining if item.startswith("-")), remaining[0])
    if not unknown.startswith("-"):
        raise ConfigError(f"command line: unexpected value {unknown!r} (flags take the form --key value)")
    raise _unknown_key_error(unknown.lstrip("-").split("=")[0], sorted(_actions(parser)), "command line")


def _place(message: str, cli_args: list[str], config_path: str | None) -> str:
    """Rewrite argparse's "argument --key/--alias: problem" as "<source>: key 'key': problem"."""
    named = re.match(r"argument --([\w-]+)(?:/--[\w-]+)*: (.*)", message, re.DOTALL)
    if named is None:
        return f"command line: {message}"
    key, problem = named.group(1).replace("-", "_"), named.group(2)
    on_command_line = key in _flag_keys(cli_args)
    source = "command line" if config_path is None or on_command_line else f"config file {config_path}"
    return f"{source}: key {key!r}: {problem}"


def _flag_keys(cli_args: list[str]) -> set[str]:
    """The keys that command-line flags set (`--max-length 3` and `--max_length=3` both set max_length)."""
    return {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in cli_args if arg.startswith("--")}
