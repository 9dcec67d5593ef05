"""A simulated vLLM model server: scheduler engine and OpenAI/Prometheus HTTP front."""
