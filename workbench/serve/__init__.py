"""The OpenAI-compatible server (``app``, ``async_engine``, ``protocol``, ``prom``) and its benchmark client
(``benchmark``). Needs the ``serve`` extra (aiohttp, prometheus_client); core modules never import this package."""
