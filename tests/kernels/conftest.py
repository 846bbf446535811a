"""Fixtures of the kernel tests (shared helpers live in kernel_checks.py)."""

from kernel_checks import poisoned_outputs  # noqa: F401  (registers the fixture for this folder)
