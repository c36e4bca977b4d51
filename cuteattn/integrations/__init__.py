"""Integrations with frameworks that call attention for the user (optional dependencies)."""
