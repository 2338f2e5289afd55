"""The OpenAI-compatible HTTP server (`shardserve serve`); see serve_cmd.py."""
