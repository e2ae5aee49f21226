"""`rl inference`: vLLM's OpenAI-compatible server plus asyncrl's admin routes."""
