"""The guides (Markdown), shipped as package data so that error messages can point to them."""
