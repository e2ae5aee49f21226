"""`rl inference`: vLLM's OpenAI-compatible server plus asyncrl's own routes (server.py)."""
