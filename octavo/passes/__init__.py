"""Compiler passes over the FX graph, run by one manager (see manager.py)."""

from octavo.passes.context import PassContext
from octavo.passes.manager import run_pipeline
from octavo.passes.registry import PASSES, PIPELINES, register_pass, resolve_pipeline

__all__ = ["PASSES", "PIPELINES", "PassContext", "register_pass", "resolve_pipeline", "run_pipeline"]
