"""The embedded tiny Llama the demo runs on (config and checkpoint data)."""
