"""Binding a family declaration to a model's config.json."""
