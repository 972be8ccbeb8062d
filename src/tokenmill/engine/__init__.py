"""The engine: what builds the model and steps it, and the clients that drive it.

    builder.build_core(EngineConfig) -> BuiltCore (model, KV cache, runner, core)
    loop.StepLoop: the one step loop (messages in, core.step(), reports out)
    client.EngineClient: the interface the server and the offline LLM drive it through
    process.ProcessClient: the engine in its own process, over a pipe (the server)
    inproc.InprocClient: the engine in the caller's thread (the offline LLM)
    messages: the records that cross the pipe (standard library and core types only)

Everything here but ``messages``, ``client``, ``loop``, ``cpu_share`` and ``process``'s
client may import torch; the HTTP process imports only those.
"""
