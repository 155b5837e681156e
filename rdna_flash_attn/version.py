"""The package version, in a module of its own so every layer (the CLI, the benchmark's records) can
read it without importing the package's public API."""

__version__ = "0.1.0"  # pyproject.toml's version; tests/packaging checks the two agree
