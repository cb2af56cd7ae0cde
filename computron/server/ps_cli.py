"""``computron ps``: what a running server holds, as ``ollama ps`` prints it.

    computron ps                                   # the server on 127.0.0.1:8000
    computron ps --port 8001 --api-key sk-1
    computron ps --url http://node-a:8000 --json   # the raw rows of GET /api/ps

One line per served model: its id, residency (disk, host, loading, resident, offloading), bytes in host
memory and on each device, when its last request was answered, and until when it stays resident if nothing
comes for it (``forever``: while memory allows; ``-``: not resident, or busy). Asks ``GET /api/ps``
(``ps.py``) with the standard library's HTTP client: no torch, no FastAPI, so it answers at once. Exit
status 1, with one line naming the URL, when the server cannot be reached or refuses the key.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

COLUMNS = ("NAME", "STATE", "HOST", "DEVICE", "LAST USED", "UNTIL")


def add_ps_parser(sub) -> None:
    p = sub.add_parser("ps", help="list a running server's models: state, memory, last use, kept until",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the server's base URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", dest="api_key", help="bearer token, when the server has keys")
    p.add_argument("--json", action="store_true", help="print GET /api/ps's JSON instead of the table")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default 10)")


def human_bytes(n: int) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _ago(seconds: float) -> str:
    s = int(max(0, seconds))
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if s >= size:
            k = s // size
            return f"{k} {unit}{'s' if k > 1 else ''}"
    return "0 seconds"


def last_used(t: Optional[float], now: float) -> str:
    return "never" if t is None else f"{_ago(now - t)} ago"


def until(row: Dict[str, Any], now: float) -> str:
    if row.get("expires_at") is not None:
        left = row["expires_at"] - now
        return "now" if left <= 0 else f"{_ago(left)} from now"
    if row.get("state") != "resident":
        return "-"
    return "forever" if row.get("keep_alive_s", -1) < 0 else f"{row.get('keep_alive')} after its requests"


def table(rows: List[Dict[str, Any]], now: float) -> str:
    lines = [COLUMNS] + [(r["name"] + (f" (on {r['base']})" if r.get("base") else ""), r["state"],
                          human_bytes(r.get("host_bytes", 0)), human_bytes(r.get("device_bytes", 0)),
                          last_used(r.get("last_used"), now), until(r, now)) for r in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("   ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def fetch(url: str, api_key: Optional[str], timeout: float) -> Dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/api/ps")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ps_main(args: argparse.Namespace) -> int:
    url = args.url or f"http://{args.host}:{args.port}"
    try:
        data = fetch(url, args.api_key, args.timeout)
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read())["error"]["message"]
        except Exception:  # noqa: BLE001 - whatever the body is, the status says enough
            why = exc.reason
        print(f"computron ps: {url}/api/ps answered {exc.code}: {why}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"computron ps: cannot reach a computron server at {url}: {getattr(exc, 'reason', exc)}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(table(data["models"], data.get("time", time.time())))
    return 0
