"""Exception types shared by every stage. User mistakes derive from KgenUserError:
the CLI prints their message and exits 2 without a traceback."""

from __future__ import annotations


class KgenError(Exception):
    """Base of every kgen exception."""


class KgenUserError(KgenError):
    """Something the user gave us is wrong (a spec, an argument, a path)."""


class SpecError(KgenUserError):
    """A spec file failed to load or validate. `.errors` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class ArgumentError(KgenUserError, ValueError):
    """A kernel call argument has the wrong shape, dtype, device, contiguity or value."""


class UnsupportedError(KgenUserError):
    """The spec is valid but asks for something kgen does not generate yet."""


class ToolchainError(KgenError):
    """A compiler or library kgen needs (NVRTC, CUDA headers, g++) is missing or broken."""


class CompileError(KgenError):
    """Generated source failed to compile. The message shows the failing lines."""


class KernelRuntimeError(KgenError):
    """A kernel launch failed (CPU-backend deadlock, sanitizer report, CUDA error)."""


class VerificationError(KgenError):
    """A kernel failed verification (`kgen.load_source` of a hand-written source whose matrix has a
    failing case). `.report` is the VerificationReport: every case, the seed to replay it."""

    def __init__(self, message: str, report=None):
        self.report = report
        super().__init__(message)


class AuditError(KgenError):
    """An audited call (`kern.audit(rate)`) disagreed with the trusted recomputation beyond the
    verifier's bound. `.result` is the CaseResult of the comparison (where, got, expected, bound)."""

    def __init__(self, message: str, result=None):
        self.result = result
        super().__init__(message)


class AuditWarning(UserWarning):
    """What an audited kernel with on_mismatch="warn" emits for a mismatch (warnings.warn)."""
