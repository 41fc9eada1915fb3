"""The device side of the engine: a Worker loads the model, plans and allocates the KV
cache, picks the kernels and runs steps described by plain data (tokenmill.core.step)."""
