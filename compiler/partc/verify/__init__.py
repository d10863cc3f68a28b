"""`partc verify`: a family's split checked against the model's own Hugging Face modeling code.

`reference.py` builds a small random model of the architecture from a config (torch and
transformers); `run.py` compiles the family for it, loads every rank with the generated loaders
and checks that the ranks' parts add up to the full model, module by module and stage by stage.
Nothing outside this room imports torch's modeling side or transformers.
"""
