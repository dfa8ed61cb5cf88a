"""The serving tier: router, prefill and decode workers, ``kvstore serve``, the OpenAI-style
HTTP front, the demo, and their wire protocol (``serving.proto``)."""
