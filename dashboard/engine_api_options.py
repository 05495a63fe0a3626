"""The API options an engine the dashboard (re)starts runs with: those of the run it restarts.

``./run.sh``'s engine serves the OpenAI-compatible API, and a restarted engine must serve it where
the user's clients are: the same port, address, queue limit and frontend mode, read from the run's
recorded command line (recorded as ``" ".join(argv)``: these values hold no spaces). The API key is
never recorded (the line says ``<redacted>``), so a run that had one restarts only when the user
types it again; it reaches the engine through its environment (``CHUNKSCOPE_API_KEY``), not its
command line. Pure: the start form (``panels/engine_process.py``) calls it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "CHUNKSCOPE_API_KEY"          # engine/api/launch.py reads it when --api-key is not given
_DIGITS = re.compile(r"[0-9]{1,7}")
_HOST = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9.:\-\[\]]{0,252}")   # a name, IPv4 or IPv6 address: never an option


class ApiOptionError(ValueError):
    """A port, host or key the engine cannot be started with; the message says which."""


@dataclass(frozen=True)
class ApiOptions:
    port: str = ""                # "": no API
    host: str = DEFAULT_HOST
    max_waiting: str = ""         # "": the engine's default
    separate_process: bool = True
    needs_key: bool = False       # the run required an API key (recorded redacted)

    @classmethod
    def from_run(cls, run: dict) -> "ApiOptions":
        """From the run's row: its command line, and ``workload.api_key_required`` (set however the key
        was given: on the command line, or in the environment as a dashboard restart passes it)."""
        options = cls.from_command_line(run.get("command_line"))
        workload = run.get("workload") if isinstance(run.get("workload"), dict) else {}
        return replace(options, needs_key=options.needs_key or workload.get("api_key_required") is True)

    @classmethod
    def from_command_line(cls, line: str | None) -> "ApiOptions":
        words = (line or "").split()
        found: dict[str, str] = {}
        for i, word in enumerate(words):
            name, eq, value = word.partition("=")
            if len(name) >= len("--api-k") and "--api-key".startswith(name):   # argparse takes a prefix
                name = "--api-key"
            if name in ("--api-port", "--api-host", "--max-waiting", "--api-key"):
                found[name] = value if eq else (words[i + 1] if i + 1 < len(words) else "")
        port = found.get("--api-port", "")
        return cls(port=str(int(port)) if _DIGITS.fullmatch(port) else port,   # 0008000 -> 8000
                   host=found.get("--api-host", DEFAULT_HOST), max_waiting=found.get("--max-waiting", ""),
                   separate_process="--no-api-process" not in words, needs_key="--api-key" in found)

    def argv_and_env(self, port: str | int | None, key: str = "") -> tuple[list[str], dict[str, str | None]]:
        """(the serve options, the environment changes: None removes a variable) for the form's ``port`` and
        ``key``. The dashboard's own ``CHUNKSCOPE_API_KEY`` never reaches an engine the form gave no key."""
        text = "" if port is None else str(port).strip()
        if not text:
            return [], {API_KEY_ENV: None}
        if not _DIGITS.fullmatch(text) or int(text) > 65535:
            raise ApiOptionError(f"API port {_shown(text)} is not a port number (0-65535; 0: any free port), "
                                 "or leave it blank")
        if not _HOST.fullmatch(self.host or ""):
            raise ApiOptionError(f"API host {_shown(self.host)} is not a host name or address")
        if self.needs_key and not key:
            raise ApiOptionError("the run required an API key (its recorded command line hides it): type it, "
                                 "or clear the API port to start without the API")
        if key and (not key.strip() or not key.isprintable()):
            raise ApiOptionError("the API key must be printable text (no control characters), not blank")
        argv = ["--api-port", str(int(text)), "--api-host", self.host]
        if _DIGITS.fullmatch(self.max_waiting):
            argv += ["--max-waiting", self.max_waiting]
        if not self.separate_process:
            argv.append("--no-api-process")
        return argv, {API_KEY_ENV: key or None}


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")
