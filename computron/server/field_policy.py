"""What happens to a request field a route does not know.

It is ignored and logged once per field name at WARNING (what vLLM, SGLang, Ollama and llama.cpp's server
do), unless strict mode is on (``server.strict_fields``, ``--strict-fields``, or a model's
``strict_fields``): then it answers 400 naming it. ``ServerState`` holds one ``FieldPolicy``. Pure Python.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Set

from .errors import bad

log = logging.getLogger("computron.server")


class FieldPolicy:
    """What happens to the fields a route does not know: ignored and logged once per name, or (strict) 400."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._logged: Set[str] = set()

    def unknown(self, body: Dict[str, Any], known: Iterable[str], where: str,
                strict: Optional[bool] = None) -> List[str]:
        """The fields of ``body`` outside ``known``: 400 naming the first in strict mode (``strict`` overrides
        the server's setting, from the model's config), else each new name logged once; returns them."""
        known = set(known)
        extra = sorted(k for k in body if k not in known)
        if not extra:
            return extra
        if self.strict if strict is None else strict:
            raise bad(extra[0], f"unsupported field {extra[0]!r} (strict mode: unknown fields are refused)")
        for k in extra:
            if k not in self._logged:
                self._logged.add(k)
                log.warning("%s: ignoring the unknown request field %r (logged once per field name)", where, k)
        return extra
