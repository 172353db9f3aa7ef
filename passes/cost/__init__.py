"""Pricing: per-op compute, collectives and resharding, gradient buckets, a plan's score."""
