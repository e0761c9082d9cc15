"""Shared fixtures for the kernel tests. The kernel side never needs torch, so neither do these imports."""
from __future__ import annotations

import os

os.environ.setdefault("SUPERKERNEL_FRONTEND", "1")
