"""The built-in family library: YAML/TOML inputs shipped as package data, never code."""
