"""The `partc` command line (`partc.cli.main:main`, also `python -m partc` and
`python -m partc.cli`).

`parser.py` holds the arguments of every command and the exit statuses; `main.py` parses them,
runs one command and turns what went wrong into a report; `diagnostics.py` writes the error
reports (text with a caret under the source, or JSON); `compiling.py` runs compile, check,
demo, shard and verify. The seeing and authoring commands are `partc.cli.commands`.
"""
