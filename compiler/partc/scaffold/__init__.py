"""`partc init`: a family scaffold guessed from a checkpoint header and its config.json:
`survey` reads them, `family_text` builds the family (`layer_groups`, `encoder_groups`: its
groups; `decisions`: how each dimension is written, what is marked), `yaml_writer` writes it."""
