"""Adapters for the frameworks flashrl_kernels plugs into (vLLM, ...).

Each adapter lives in its own subpackage and imports its framework only when
used, so `import flashrl_kernels` never imports vLLM, TRL or verl.
"""
