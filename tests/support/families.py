"""The mini family: the smallest valid family file, in YAML and TOML, and its config."""

from __future__ import annotations

MINI = """\
family: mini
model_types: [mini]
config:
  hidden_size: int
  num_layers: int
  vocab_size: int
graph:
  - {group: decoder, units: num_layers, path: "model.layers.{unit}", state: true}
static:
  embedding: {stage: first}
parameters:
  - name: embedding
    role: vocabulary
    owner: {static: embedding}
    module: model.embed_tokens
    sharding: {balanced: 0}
    params: {weight: [vocab_size, hidden_size]}
  - name: "layers.{unit}.mlp"
    role: feed_forward_intermediate
    owner: {unit: decoder}
    units: hidden_size
    projections:
      - {module: "model.layers.{unit}.up", sharding: column, params: {weight: [hidden_size, 8]}}
      - {module: "model.layers.{unit}.down", sharding: row, params: {weight: [8, hidden_size]}}
boundary:
  identity: mini.hidden
  primary: {role: hidden, shape: [batch, sequence, hidden_size], dtype: activation}
"""
"""The mini family in YAML: one embedding and a decoder of column/row MLPs."""

MINI_TOML = """\
family = "mini"
model_types = ["mini"]

[config]
hidden_size = "int"
num_layers = "int"
vocab_size = "int"

[[graph]]
group = "decoder"
units = "num_layers"
path = "model.layers.{unit}"
state = true

[static]
embedding = {stage = "first"}

[[parameters]]
name = "embedding"
role = "vocabulary"
owner = {static = "embedding"}
module = "model.embed_tokens"
sharding = {balanced = 0}

[parameters.params]
weight = ["vocab_size", "hidden_size"]

[[parameters]]
name = "layers.{unit}.mlp"
role = "feed_forward_intermediate"
owner = {unit = "decoder"}
units = "hidden_size"

[[parameters.projections]]
module = "model.layers.{unit}.up"
sharding = "column"
params = {weight = ["hidden_size", 8]}

[[parameters.projections]]
module = "model.layers.{unit}.down"
sharding = "row"
params = {weight = [8, "hidden_size"]}

[boundary]
identity = "mini.hidden"
primary = {role = "hidden", shape = ["batch", "sequence", "hidden_size"], dtype = "activation"}
"""
"""The same mini family spelled in TOML."""

MINI_CONFIG = {"model_type": "mini", "hidden_size": 8, "num_layers": 2, "vocab_size": 16}
"""A config.json the mini family binds to cleanly."""
