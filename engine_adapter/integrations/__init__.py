"""Adapters that put the store under engines people already run (vLLM, SGLang, LMCache).

Each adapter imports its engine in its own module only, so importing this package (or
``engine_adapter``) never needs an engine installed.
"""
