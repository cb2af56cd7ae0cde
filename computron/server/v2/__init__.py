"""The Open Inference Protocol (KServe v2 REST) for encoder, classifier and ViT models.

``protocol.py`` parses infer requests into engine requests and encodes the answers (no I/O);
``routes.py`` is the ``/v2`` router. The names below are what ``computron.server.v2`` has always
offered: ``EMBEDDING`` and ``IMAGE`` (and ``SEQUENCE``, ``TOKEN``) are ``ModelKind`` members kept
under their old names.
"""
from ..building import UnderstandingModel
from ..errors import V2Error, payload_message
from ..model_kind import ModelKind
from .protocol import encode_outputs, parse_infer

SEQUENCE, TOKEN, EMBEDDING, IMAGE = (ModelKind.SEQUENCE_CLS, ModelKind.TOKEN_CLS, ModelKind.EMBEDDING,
                                     ModelKind.IMAGE_CLS)

__all__ = ["UnderstandingModel", "V2Error", "payload_message", "parse_infer", "encode_outputs",
           "SEQUENCE", "TOKEN", "EMBEDDING", "IMAGE"]
