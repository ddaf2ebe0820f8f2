"""The version of mtcli (recorded in every prepared cache's manifest)."""

__version__ = "0.1.0"
