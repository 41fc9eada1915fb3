"""OpenAI-compatible HTTP server: `python -m tokenmill.server --model DIR`."""
