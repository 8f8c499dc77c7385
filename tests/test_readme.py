"""The README's commands and code stay true: its Python compiles and imports, its files and targets exist."""

import re

from tests.helpers import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def test_python_blocks_compile_and_their_imports_resolve():
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("from ", "import ")))
        exec(imports, {})


def test_named_configs_and_make_targets_exist():
    for path in set(re.findall(r"recipes/(?:configs|accelerate)/[\w.]+\.yaml", README)):
        assert (REPO_ROOT / path).is_file(), path
    for name in set(re.findall(r"`(\w+\.yaml)`", README)):
        assert (REPO_ROOT / "recipes" / "configs" / name).is_file(), name
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE)
    assert "accelerate launch recipes/finetune_llama2.py" in makefile


def test_hf_scale_commands_print_what_the_readme_shows(capsys):
    """Each `$ hf-scale ...` block: the command runs, and every line shown (up to a trailing ...) is printed."""
    from hf_scale.cli import main

    blocks = re.findall(r"```\n\$ hf-scale (.*?)\n(.*?)```", README, re.DOTALL)
    assert len(blocks) >= 2
    for command, shown in blocks:
        assert main(command.split()) == 0, command
        printed = capsys.readouterr().out.splitlines()
        for line in shown.splitlines():
            expected = line.removesuffix("...").rstrip()
            if expected:
                assert any(out.startswith(expected) for out in printed), (command, line)
