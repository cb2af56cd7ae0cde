"""OpenAI's protocol: ``protocol.py`` parses requests and builds answers (no I/O); ``routes.py`` is the
``/v1`` router (completions, chat completions, models, embeddings)."""
