"""What every serving instrument shares: the endpoint arguments and the provenance record.

A number without its context is useless a week later, so each instrument's JSON
carries when and from which checkout it ran, the sglang version installed here and
the ``DSV4_SM120_*`` switches as this process's environment sets them. The switches
act inside the *server* processes, which a client cannot read over HTTP: run the
instruments with the same environment file the servers were launched with, and pass
the launch command lines with ``--launch-flags`` so the record says what ran.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import dsv4_sm120
from dsv4_sm120 import settings


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from what users paste (a trailing ``/`` or ``/v1`` is dropped).

    Used as the argparse ``type`` of ``--base-url``, so a bad value is a usage error
    (exit 2, with the fix) before any instrument starts, and ``args.base_url`` is normalized.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"{url!r} is not an http(s) URL; pass the server root, e.g. http://10.0.0.5:30000"
        )
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``--base-url``, ``--model``, ``--api-key``, ``--launch-flags``, ``--device`` (the same on every instrument)."""
    parser.add_argument(
        "--base-url", required=True, type=normalize_base_url, help="server or router root, e.g. http://127.0.0.1:30000 (a trailing /v1 is fine)"
    )
    parser.add_argument("--model", required=True, help="model name the endpoint serves (the 'model' field of requests)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or None,
        help="bearer token, if the endpoint wants one (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--launch-flags",
        action="append",
        default=[],
        metavar="CMDLINE",
        help="a server launch command line to keep in the record; repeat for prefill, decode and router",
    )
    parser.add_argument(
        "--device", default=None, help="what the servers run on, for the record, e.g. '2x4 RTX PRO 6000, PD over NIXL'"
    )


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _checkout_commit() -> str | None:
    """The git commit of the dsv4-sm120 checkout this runs from (None for a wheel install)."""
    root = Path(dsv4_sm120.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'+dirty' if dirty else ''}" if head else None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def provenance(tool: str, args: argparse.Namespace) -> dict:
    """The context block every instrument's JSON starts with."""
    return {
        "tool": tool,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "client_host": socket.gethostname(),
        "base_url": args.base_url,
        "model": args.model,
        "launch_flags": list(args.launch_flags),
        "device": args.device,
        "dsv4_sm120_version": dsv4_sm120.__version__,
        "dsv4_sm120_commit": _checkout_commit(),
        "sglang_version_client": _installed("sglang"),
        "switches_in_force": settings.in_force(),
        "switches_note": "read from this client's environment; run with the servers' environment file",
    }


def write_json(path: str | os.PathLike | None, obj: dict) -> None:
    """Write ``obj`` to ``path`` (parents created) and always print it as one JSON object on stdout."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str)
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    print(text)


def log(msg: str) -> None:
    """Progress for humans goes to stderr, so stdout stays one JSON object."""
    print(msg, file=sys.stderr, flush=True)


def positive(kind):
    """argparse type: a number > 0 of ``kind``, with a message naming what was wrong."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse
