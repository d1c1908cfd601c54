"""Reading a text file a user names (a config, a launch script, a prompt template), with one
line for a file that is not text: unreadable, a directory, binary, UTF-16 or not UTF-8.

Standard library only: the CLI reads configs before anything heavy loads.
"""

from __future__ import annotations

from pathlib import Path

from fitrl.core.errors import ConfigError


def read_text(path: str | Path, expected: str) -> str:
    """The text of ``path``, or a :class:`ConfigError` naming it, what it is instead and the fix;
    ``expected`` says what it should be (``"a fitrl YAML config"``). A UTF-8 byte-order mark is
    dropped, as editors on Windows write one. A NUL byte in the first 8 KiB marks a binary (an
    archive, a checkpoint, a program): text never holds one, and a binary format soon does."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (give {expected})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a file (give {expected})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    fixed = f"fixed{Path(path).suffix}"
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ConfigError(f"{path}: UTF-16 text (its byte-order mark); save it as UTF-8 (e.g. `iconv -f utf-16 -t "
                          f"utf-8 {path} > {fixed}`)")
    nul = data.find(b"\0", 0, 8192)
    if nul >= 0:
        raise ConfigError(f"{path}: not a text file (a NUL byte at offset {nul}: a binary); give {expected}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: "
                          f"{e.reason}); save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path} > {fixed}`)") from None
