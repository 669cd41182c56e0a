"""The one user-facing error type.

Every error a user can cause (bad path, unknown model, prompt too long, no network...) is raised as
:class:`LocalLLMError` with a message that names the problem and a hint that names the fix.  The CLI
turns it into a one-line message and a non-zero exit; ``LOCALLLM_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations


class LocalLLMError(Exception):
    """A problem the user can fix; ``str()`` gives the one-line message (problem, then fix)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = self.message.rstrip(". ")
        if self.hint:
            text += "; " + self.hint
        return " ".join(text.split())  # one line, whatever the parts held
