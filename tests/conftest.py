"""Shared test setup. Triton's interpreter must be chosen before any kernel module imports triton."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
