"""The kernel tests' fixtures (kernelspecs in a temporary prefix, a client that runs cells), for the
``%probe`` / ``%memory`` magic tests."""
from tests.kernel.conftest import KernelSession, kernel_prefix  # noqa: F401

__all__ = ["KernelSession", "kernel_prefix"]
