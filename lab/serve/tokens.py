"""Who holds which token on a ``--auth token`` server (issue 55): the ``--token-file`` read into
people, so the run history's "who", the provenance written into files and the Runs page's "delete
your own" name the person who signed in, not one ``token`` for everyone.

The file holds either one token alone (the server's one token, as before: whoever holds it is
``token``) or one ``name token`` line per person; blank lines and whole-line ``#`` comments are
allowed. Names and tokens are each unique. A line that does not hold is refused at start-up in one
line that names the file and the line's number and never its content (which may hold a token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

UNNAMED = "token"
"""Who signs in with a file's one token alone (or with a token the server made): the name the
history and the files have always given a token server's sessions."""
MIN_TOKEN_CHARS = 16
"""The shortest token a ``--token-file`` may hold: a guessable one is no sign-in."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
NAME_RULE = "letters, digits and . _ @ -, starting with a letter or digit, at most 64 characters"
"""What a person's name may be: it is shown in the history and written into files as it is, so a
plain word or an email, nothing that reads as markup or spans columns."""


class TokenFileError(ValueError):
    """A token file the server cannot start with; the message never holds a token."""


@dataclass(frozen=True)
class Person:
    """One person who may sign in: their name (what the history and the files say) and their token
    (kept out of ``repr``, so a log or a traceback does not show it)."""

    name: str
    token: str = field(repr=False)


def parse_people(text: str, where: str) -> tuple[Person, ...]:
    """The people ``text`` (a token file's content) names; ``where`` says which file in a refusal.
    One token alone is the server's one token (held by ``UNNAMED``), as a token file always was."""
    alone = text.strip()
    if alone and not any(char.isspace() for char in alone):  # the file as it has always been: one token
        return (_alone(alone, where),)
    lines = [
        (number, line.split())
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if len(lines) == 1 and len(lines[0][1]) == 1:  # one token among comments
        return (_alone(lines[0][1][0], where),)
    if not lines:
        raise TokenFileError(f"{where} holds no token: one token alone, or one 'name token' line per person")
    people: list[Person] = []
    names: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for number, fields in lines:
        at = f"{where} line {number}"
        if len(fields) != 2:
            raise TokenFileError(f"{at}: expected 'name token' (two fields), found {len(fields)} fields")
        name, token = fields
        if NAME.fullmatch(name) is None:
            raise TokenFileError(f"{at}: the name is not a plain name ({NAME_RULE})")
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenFileError(f"{at}: the token is shorter than {MIN_TOKEN_CHARS} characters")
        if name in names:
            raise TokenFileError(f"{at}: the same name as line {names[name]} (each name once)")
        if token in tokens:
            raise TokenFileError(f"{at}: the same token as line {tokens[token]} (each person a token of their own)")
        names[name], tokens[token] = number, number
        people.append(Person(name, token))
    return tuple(people)


def read_people(path: Path, shown: str | None = None) -> tuple[Person, ...]:
    """The people the token file at ``path`` names (``shown``: how a refusal names the file, the
    path as typed; ``path`` itself by default). Raises ``TokenFileError``, the reason in one line."""
    where = f"--token-file {shown if shown is not None else str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TokenFileError(f"{where} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TokenFileError(f"{where} is not UTF-8 text") from None
    return parse_people(text, where)


def _alone(token: str, where: str) -> Person:
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(f"{where} must hold one token of at least {MIN_TOKEN_CHARS} characters and no spaces")
    return Person(UNNAMED, token)
