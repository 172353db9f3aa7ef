"""Pricing: per-op compute, collectives and resharding routes, gradient buckets."""
