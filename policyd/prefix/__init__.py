"""Prefix-cache locality: which pods hold (or likely hold) a request's prompt blocks.

Approximate mode learns from policyd's own routing, precise mode from the
pods' KV-cache events; docs/prefix-cache.md says how both work.
"""
