"""The ``aloe`` command: build, evaluate, inspect, demo, export and serve."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
