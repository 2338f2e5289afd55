"""What a stream has sent of one choice, and how much of the engine's text it may send now.

The engine yields cumulative outputs (the full text so far); a stream sends the difference. Text
is held back while it ends in an incomplete UTF-8 character ("\\ufffd", which the next token may
complete into another character) or could still be the start of a stop string (which the engine
would cut off), so the streamed pieces always add up to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.outputs import CompletionOutput


def hold_length(stops: list[str]) -> int:
    """How many trailing characters to hold back: a stop string's longest proper prefix."""
    return max((len(s) for s in stops), default=1) - 1


@dataclass(frozen=True)
class StreamPiece:
    """The part of a choice that one chunk sends."""

    text: str
    first_token: int  # index in token_ids of the first token this chunk covers (for logprobs)
    first: bool  # the choice's first chunk (chat's carries the role)


@dataclass
class ChoiceStream:
    """What streaming has already sent of one choice."""

    hold: int  # see hold_length
    send_empty_first: bool  # the first chunk goes out even without text (chat: the role)
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    started: bool = False
    finished: bool = False

    def advance(self, c: CompletionOutput) -> StreamPiece | None:
        """The next piece to send of c (a cumulative output), or None when there is nothing to
        send yet; records it as sent."""
        if self.finished:
            return None
        end = self._sendable_end(c)
        text = c.text[self.text_len:end]
        if not text and c.finish_reason is None and (self.started or not self.send_empty_first):
            return None
        piece = StreamPiece(text, self.num_tokens, not self.started)
        self.text_len, self.num_tokens = max(end, self.text_len), len(c.token_ids)
        self.started, self.finished = True, c.finish_reason is not None
        return piece

    def _sendable_end(self, c: CompletionOutput) -> int:
        """Where the text that may be sent ends: all of it once finished (the engine has cut
        off any stop string), else short of a trailing partial character and self.hold."""
        end = len(c.text)
        if c.finish_reason is not None:
            return end
        while end > self.text_len and c.text[end - 1] == "\ufffd":
            end -= 1
        return max(self.text_len, end - self.hold)
