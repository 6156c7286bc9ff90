"""Offline selectors and their shared pieces: pool → subset."""
