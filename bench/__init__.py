"""Benchmarks: ``python -m bench`` runs every case and prints one table (see BENCHMARKS.md)."""
