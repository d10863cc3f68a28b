"""Jinja2 templates of the generated loader modules."""
