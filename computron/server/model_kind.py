"""What a served model does: one ``ModelKind`` for the config, the served-model registry and the routes.

``config.understanding_kind`` decides each model's kind from its checkpoint (and its ``task``); the
routes read it to send a text generator to ``/v1/completions`` and ``/v1/chat/completions`` and an
encoder or ViT model to ``/v2/models/{id}/infer`` (embedding models also to ``/v1/embeddings``).
The values are the words the config, the logs and the error messages use. Import-light: the CLI's
``--help`` path reads it through ``config``.
"""
import enum


class ModelKind(str, enum.Enum):
    GENERATION = "causal_lm"
    """A causal LM: text in, text out."""
    SEQUENCE_CLS = "sequence-classification"
    TOKEN_CLS = "token-classification"
    EMBEDDING = "embedding"
    IMAGE_CLS = "image-classification"

    def __str__(self) -> str:  # the value, in messages and f-strings alike
        return self.value

    __format__ = str.__format__

