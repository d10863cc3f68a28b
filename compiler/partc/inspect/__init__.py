"""Seeing a plan: inspect, explain and report a build; inventory a checkpoint."""
