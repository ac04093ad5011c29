"""The HTTP front door: the FastAPI app and its routes, and the bounded connection layer."""
