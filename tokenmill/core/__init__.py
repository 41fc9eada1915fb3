"""The engine's pure core: request state, the token-budget scheduler, the KV block
manager and the plain data a step is described by. Imports no torch and nothing of
tokenmill but `config`, `sampling_params` and `outputs`, so it can be tested alone
and its step data can be sent to a worker in another process."""
