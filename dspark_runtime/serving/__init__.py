"""`dspark serve`: the OpenAI-compatible FastAPI app, its wire format, the engine worker thread and its
metrics, and Ray Serve replicas."""
