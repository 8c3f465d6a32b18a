"""Shim for tools that still call setup.py: the metadata, dependencies and version live in pyproject.toml."""

from setuptools import setup

setup()
