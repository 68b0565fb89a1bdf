"""Errors a user can cause, and the exit codes the CLI maps them to."""

EXIT_ERROR = 1
EXIT_GATE_FAILED = 3
EXIT_GATE_INCONCLUSIVE = 4


class QserveError(Exception):
    """A failure with a one-line message meant for the user (no traceback)."""


class InvalidSpec(QserveError, ValueError):
    """A recipe or gate value that is not valid. Also a ValueError, so pydantic validators that
    raise it report it as a validation error of the field."""


class UnsupportedOnDevice(QserveError):
    """vLLM cannot run this checkpoint correctly on the current device."""


class Stopped(Exception):
    """SIGINT or SIGTERM asked qserve to stop; the CLI exits 128 + the signal number (130, 143)."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or the RuntimeError/OSError that torch's
    allocator and the OS raise with "cannot allocate memory" (ENOMEM), which have no type of their own."""
    import errno

    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    return isinstance(exc, (RuntimeError, OSError)) and "allocate memory" in str(exc).lower()


def innermost_message(exc: BaseException) -> str:
    """A library's message on one line: the innermost cause's type and last non-empty line (where
    vLLM and transformers put the reason, under their own wrapping)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        inner = exc.__cause__ or exc.__context__
        if not str(inner).strip():
            break
        exc = inner
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:400]
