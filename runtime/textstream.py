"""Streaming text filters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class StopStringFilter:
    """Cut a text stream at the first stop string, without ever printing part of one.

    Feed the pieces as they are decoded; each :meth:`feed` returns what is safe to print now.  A tail
    that could be the start of a stop string is held back until the next piece settles it.  Once a
    stop string appears, the text before it is returned (the last text of the stream) and
    :attr:`stopped` becomes true; later calls return ''.  :meth:`flush` returns a held-back tail
    at the end of the stream.  Empty stop strings are ignored.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stops = sorted({s for s in stop if s}, key=len)
        self._held = ""
        self.stopped = False
        #: The stop string that ended the stream, if any.
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        # Earliest stop string wins; on a tie at one position the shortest (first in self._stops).
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            index, self.hit = min(found, key=lambda f: f[0])
            self.stopped = True
            self._held = ""
            return text[:index]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail: at the end of the stream it is plain text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=0)
        for size in range(min(len(text), longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0


class ThinkingSplitter:
    """Split a reply stream into its thinking block (``<think>…</think>``, as Qwen3 and DeepSeek-R1
    write it) and its answer, without ever splitting a tag across the two.

    :meth:`feed` takes decoded pieces and returns ``(kind, text)`` pairs, kind "thinking" or
    "answer", in order. A tail that could be the start of a tag is held back until the next piece
    settles it. Only a block that opens the reply (after whitespace) counts as thinking; a reply
    whose template already opened it (``opened=True``: the prompt ends inside ``<think>``) starts in it.
    """

    OPEN, CLOSE = "<think>", "</think>"
    #: Harmony's (gpt-oss) message tokens: ``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ TYPE]<|message|>``
    #: then the message, ended by one of :attr:`ENDS`.
    START, CHANNEL, MESSAGE, ENDS = "<|start|>", "<|channel|>", "<|message|>", ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, opened: bool = False, harmony: bool = False) -> None:
        """``harmony``: the reply is harmony's messages (:func:`template_channels`): the analysis
        channel is thinking, final and commentary the answer (their headers left out), and a message
        with a recipient (a call) passes on whole as answer, from ``<|start|>assistant`` (which its
        header is given when the reply opens with it) to its end token, for the call parser."""
        self._held = ""
        self._harmony = harmony
        self._state = "thinking" if opened else "start"  # start -> thinking -> after -> answer, or start -> answer

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self._harmony:
            return self._feed_messages(piece)
        text = self._held + piece
        self._held = ""
        out: list[tuple[str, str]] = []
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(self.OPEN):
                    self._state = "thinking"
                    text = stripped[len(self.OPEN):]
                    continue
                if not stripped or self.OPEN.startswith(stripped):  # whitespace, or maybe a tag to come
                    self._held = text
                    break
                self._state = "answer"
                continue
            if self._state == "after":  # the blank line after the closing tag is the template's, not the answer's
                text = text.lstrip("\n")
                if not text:
                    break
                self._state = "answer"
            if self._state == "answer":
                out.append(("answer", text))
                break
            end = text.find(self.CLOSE)
            if end >= 0:
                if end:
                    out.append(("thinking", text[:end]))
                self._state = "after"
                text = text[end + len(self.CLOSE):]
                continue
            keep = next((n for n in range(min(len(text), len(self.CLOSE) - 1), 0, -1)
                         if self.CLOSE.startswith(text[-n:])), 0)
            if len(text) > keep:
                out.append(("thinking", text[: len(text) - keep]))
            self._held = text[len(text) - keep:] if keep else ""
            break
        return out

    def _feed_messages(self, piece: str) -> list[tuple[str, str]]:
        """Harmony: states "start" (a header, held until ``<|message|>`` decides it), then "thinking",
        "answer" or "call" (a message's body, up to its end token)."""
        text = self._held + piece
        self._held = ""
        out: list[tuple[str, str]] = []
        while text:
            if self._state == "start":
                head = next((h for h in (self.START, self.CHANNEL) if text.startswith(h) or h.startswith(text)), None)
                if head is None:  # no header: text of the answer's
                    self._state = "answer"
                    continue
                at = text.find(self.MESSAGE)
                if at < 0:
                    self._held = text  # a header still being written
                    break
                header, text = text[:at], text[at + len(self.MESSAGE):]
                if " to=" in header:
                    self._state = "call"
                    start = "" if header.startswith(self.START) else self.START + "assistant"
                    out.append(("answer", start + header + self.MESSAGE))
                else:
                    channel = header.partition(self.CHANNEL)[2].split(" ", 1)[0]
                    self._state = "thinking" if channel == "analysis" else "answer"
                continue
            # a message ends at its end token, or where the next one starts (a model that left it out)
            ends = [(i, e) for e in (*self.ENDS, self.START) if (i := text.find(e)) >= 0]
            if ends:
                at, end = min(ends)
                taken = len(end) if end != self.START else 0  # the next message's start stays its own
                # a call passes on with its end (<|end|> where it had none) for the call parser
                body = text[:at] + (text[at : at + taken] or self.ENDS[0]) if self._state == "call" else text[:at]
                if body:
                    out.append(("thinking" if self._state == "thinking" else "answer", body))
                self._state, text = "start", text[at + taken:]
                continue
            bounds = (*self.ENDS, self.START)
            keep = next((n for n in range(min(len(text), max(map(len, bounds)) - 1), 0, -1)
                         if any(e.startswith(text[-n:]) for e in bounds)), 0)
            if len(text) > keep:
                out.append(("thinking" if self._state == "thinking" else "answer", text[: len(text) - keep]))
            self._held = text[len(text) - keep:]
            break
        return _merged(out)

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, at the end of the stream (an unclosed block stays thinking; harmony: a
        header never finished is no text)."""
        held, self._held = self._held, ""
        if not held or (self._harmony and self._state == "start"):
            return []
        return [("thinking" if self._state == "thinking" else "answer", held)]


def _merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Adjacent parts of one kind as one."""
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def template_channels(template: str | None) -> bool:
    """Whether a chat template is harmony's (gpt-oss): its replies are messages on channels, whose
    headers are special tokens, so a reply is decoded with its special tokens (and split by
    :class:`ThinkingSplitter` in its harmony mode)."""
    text = template or ""
    return ThinkingSplitter.CHANNEL in text and ThinkingSplitter.MESSAGE in text


def template_thinks(template: str | None) -> bool:
    """Whether a chat template is a thinking model's (it writes or reads ``<think>`` blocks, or
    harmony's analysis channel)."""
    return ThinkingSplitter.OPEN in (template or "") or template_channels(template)


def prompt_opens_thinking(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside an opened ``<think>`` (DeepSeek-R1 distills' templates do)."""
    return tokenizer.decode(list(ids[-8:])).rstrip().endswith(ThinkingSplitter.OPEN)
