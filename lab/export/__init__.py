"""Exports: what a choice becomes on disk (the Observer Lab JSON and its schema, the
compressed-tensors config and tensors), with values made JSON-safe in one place."""
