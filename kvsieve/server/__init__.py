"""``kvsieve serve``: an OpenAI-compatible HTTP server whose every request's KV memory is bounded, admitted against a
cap before it runs, and measured.

``app`` (routes, errors, server-sent events), ``schemas`` (request bodies), ``scheduler`` (the worker thread that owns
the model: admission and the decode loop), ``memory`` (a request's bytes before it runs), ``decoding`` (sampling,
text and stop strings), ``metrics`` (Prometheus). Needs the ``serve`` extra: ``pip install 'kvsieve[serve]'``.
"""
