"""The HTML report template."""
