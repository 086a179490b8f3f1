"""The package version (one place; setup reads pyproject.toml, which must agree)."""
__version__ = "0.1.0"
