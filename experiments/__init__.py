"""Reproducible experiments: `python -m experiments.<name>` writes results/<name>/{csv,png,md}."""
