"""How the async engine fails a request (the server maps each to an HTTP status)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop died; every open and future request fails with this."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or stopped): no new requests or admin calls."""


class EngineStalledError(EngineDeadError):
    """One engine step has run longer than step_timeout (the engine may recover)."""


class EngineOverloadedError(RuntimeError):
    """Admission control: too many sequences are already admitted; retry later."""


class RequestFailedError(RuntimeError):
    """This request failed on the engine thread (the reason is the message); the
    engine and every other request carry on."""
