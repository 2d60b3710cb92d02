"""Adapters that plug kvtier into inference engines; each needs its optional extra installed.

`kvtier.integrations.transformers` (the `transformers` extra) reuses cached KV in a Hugging
Face transformers causal LM. Nothing here is imported by the core package.
"""
