"""Helpers for the deployment tests: rendering manifests, installing and running the units."""
