"""tokenmill: an LLM inference and serving engine where every optimization is a measured switch."""
