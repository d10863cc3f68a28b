"""Code generation: rank modules and package inits from a plan, rendered and checked."""
