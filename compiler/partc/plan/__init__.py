"""Stage 5, the plan: a bound architecture realized for a topology as a frozen plan IR.

Read in pipeline order: `topology.py` (the T x S (x E x X) topology and its checks),
`ranks.py` (group kinds, planned groups, rank plans and their accounting), `experts.py` (the
expert-parallel layout, placement and ranks), `ir.py` (`Plan`, its canonical JSON and hash) and
`realize.py` (`realize_plan`, which builds them). Each name is imported from its own module.
"""
