"""OpenAI's protocol, by owner: ``fields.py`` (typed field checks), ``protocol.py`` (completion params and the
engine requests they become), ``chat.py`` (messages, tools, tool_choice), ``tool_parsers.py`` (tool calls in
answers), ``logprobs.py`` (logprob shapes), ``choices.py`` (one choice's text and finish reason),
``answer.py`` (the answer objects and chunks), ``responses.py`` (the Responses API's shapes),
``embeddings.py``; no I/O in any of them. The routers: ``routes.py`` (``/v1`` completions, chat, models,
embeddings; ``runner.py`` drives the engine sequences), ``responses_routes.py``, ``tokenize_routes.py``,
``lora_routes.py``."""
