"""One rule for peer strings: escaped and cut before a log, a terminal or a label sees them.

Everything a peer wrote (ids, REJECT reasons and messages, remote exception texts,
statistics answers) is hostile until it passed through `peer_text`: control characters
(C0, DEL, C1, ESC and so terminal escape and OSC sequences, line and paragraph
separators, bidirectional overrides) become visible escapes such as ``\\x1b``, and the
text is cut to a bound. A log line therefore stays one line (no forged records), a
terminal never receives an escape sequence, and a label or table cell has a bounded
width. Markup is a matter of the renderer: ``tensorrpc top`` draws peer strings as plain
``rich.text.Text``, never as markup.

Ids with control characters never get this far: the protocol refuses them when it decodes
a HELLO or WELCOME (``_protocol``, the ``name`` fields), so this module is the second line
for ids and the only one for free text.

Sans-I/O: no imports beyond the standard library.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["CONTROL", "MAX_SHOWN", "peer_text"]

#: Longest peer string shown by default (characters before escaping).
MAX_SHOWN: Final = 200

#: Characters a peer string may not carry raw into a log line, a terminal or a label:
#: C0 controls, DEL, C1 controls, U+2028/U+2029 and the bidirectional embeddings,
#: overrides and isolates (they reorder what a reader sees).
CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
#: The same without ``\n`` and ``\t``: multi-line texts (tracebacks) keep their lines.
_CONTROL_KEEP_LINES: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)
_SHORT: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\x1b"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    short = _SHORT.get(char)
    if short is not None:
        return short
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def peer_text(value: object, limit: int | None = MAX_SHOWN, *, lines: bool = False) -> str:
    """``value`` (a string a peer wrote) made safe to log, print or use as a label.

    Args:
        value: The peer's string; anything else is shown as its ``repr``.
        limit: Most characters returned, escapes included (a longer text is cut and
            ends in ``...``); None: no bound.
        lines: Keep ``\\n`` and ``\\t`` (multi-line texts such as tracebacks); every
            other control character is still escaped.

    Returns:
        One line (unless ``lines``) without control characters, at most ``limit``
        characters long.
    """
    text = value if type(value) is str else repr(value)
    if limit is not None and len(text) > limit:
        text = text[:limit]  # escaping only lengthens: cut first, so the work is bounded
        cut = True
    else:
        cut = False
    pattern = _CONTROL_KEEP_LINES if lines else CONTROL
    if pattern.search(text) is not None:
        text = pattern.sub(_escape, text)
    if limit is not None and (cut or len(text) > limit):
        text = text[: max(0, limit - 3)] + "..."
    return text
