"""`octavo serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one artifact."""
