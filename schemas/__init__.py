"""JSON Schemas of the authoring format and the plan IR, shipped as package data."""
