"""Keep secrets out of logs: passwords in URLs (an Optuna storage such as postgresql://user:pw@host/db),
tokens in query strings, Hugging Face access tokens.

Print `mask_url(url)` instead of a URL, and pass any text that may quote one (an error message from a database
driver, a config dump) through `mask_secrets(text)` before it is logged.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"

# Query parameters whose value is a secret: ?password=..., &access_token=..., &api-key=..., &sig=...
_SECRET_PARAMETER = re.compile(
    r"pass(word|wd)?|pwd|token|secret|api[_-]?key|access[_-]?key|private[_-]?key|auth|credential|signature|^sig$",
    re.IGNORECASE,
)
# A URL with a scheme, up to whitespace or a closing quote or bracket (as it appears inside a message).
_URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>()\[\]{}]+")
# Hugging Face user access tokens: hf_ followed by 30 or more letters and digits.
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")


def mask_url(url: str) -> str:
    """`url` with its password and secret query values replaced by ***; the rest (user, host, db) kept for logs.

    postgresql://user:secret@host:5432/db -> postgresql://user:***@host:5432/db
    https://host/x?token=abc&page=2      -> https://host/x?token=***&page=2
    A string that is not a URL comes back unchanged.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host: not a URL we can take apart, so hide all of it
        return MASK
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")  # the last "@": a password may hold an unescaped one
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = "&".join(_mask_parameter(item) for item in parts.query.split("&")) if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return url  # nothing secret: the text exactly as given
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _mask_parameter(item: str) -> str:
    name, equals, value = item.partition("=")
    if equals and value and _SECRET_PARAMETER.search(name):
        return f"{name}={MASK}"
    return item


def mask_secrets(text: str) -> str:
    """`text` with every URL in it passed through `mask_url` and every Hugging Face token replaced by hf_***."""
    text = _URL_IN_TEXT.sub(lambda match: mask_url(match.group(0)), text)
    return _HF_TOKEN.sub(f"hf_{MASK}", text)
