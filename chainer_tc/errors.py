"""Exceptions shared by the kernel loader, the NVRTC checker and the CPU emulator."""


class CompileError(RuntimeError):
    """A kernel source failed to compile; the message holds the file name and the compiler's log."""


class KernelLaunchError(RuntimeError):
    """An emulated kernel failed while running (out-of-bounds access, deadlock, trap, bad lane)."""
