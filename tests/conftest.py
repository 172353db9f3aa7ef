"""Shared by every test: its presence puts ``tests/`` on ``sys.path`` (pytest's rootdir-relative
import mode), so any test imports the shared helpers as ``from harness.spmd import ...``."""
