"""The engine process: what builds the model and steps it.

    builder.build_engine(EngineConfig) -> Engine (model, KV cache, runner, core)
    process.start_engine_process(config) -> (pipe, EngineInfo, process)
    messages: the records that cross the pipe (standard library and core types only)

Everything here but ``messages`` and ``process``'s starter may import torch; the HTTP
process imports only those two.
"""
