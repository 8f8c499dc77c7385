"""The fine-tuning and search recipes and their configs, shipped in the package.

`hf-scale train` and `hf-scale search` run these files from an installed wheel; `recipes/finetune_llama2.py` and
`recipes/search_llama2.py` in the repository launch the same ones. `hf-scale recipes copy` copies one out to edit.
"""
