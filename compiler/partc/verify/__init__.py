"""`partc verify`: a family's split checked against the model's own Hugging Face modeling code.

`reference.py` builds a small random model of the architecture from a config (torch and
transformers); `run.py` (`verify_family`) compiles the family for it and loads every rank with
the generated loaders (`session.py`: the reference model, its captured module inputs and masked
copies); `modules.py` checks that the ranks' parts add up to the full model module by module,
`pipeline.py` stage by stage and cut by cut; `report.py` holds the checks and the report.
Nothing outside this room imports torch's modeling side or transformers.
"""
