"""The error a rejected request raises (its own module: validation and the chat checks both raise it)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine will not run; the message says why.

    ``param`` names the offending field as the protocol spells it ("rid", "prompt",
    "sampling.top_p", ...; None when no single field is to blame) so a front end
    can translate it (the HTTP API says "top_p"); ``code`` tells the kind of fault.
    """

    def __init__(self, param: str | None, detail: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param} {detail}" if param else detail)
        self.param = param
        self.detail = detail
        self.code = code
