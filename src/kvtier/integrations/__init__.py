"""Adapters that plug kvtier into inference engines; each needs its optional extra installed.

`kvtier.integrations.vllm` is vLLM's KV connector, `kvtier.integrations.sglang` an SGLang
HiCache storage backend, and `kvtier.integrations.transformers` (the `transformers` extra) reuses
cached KV in a Hugging Face transformers causal LM; `seam` holds what they share. Nothing here
is imported by the core package.
"""
