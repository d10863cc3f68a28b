"""The authoring front end: documents with source positions, and the JSON Schema pass."""
