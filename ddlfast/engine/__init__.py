"""The engine layer below the Context facade: requests validated on the caller's thread, the per-call agreement,
the host and GPU executors (twins over the core's one transport), the latency fast path, the small collectives,
the communication thread and the timeline. Every function takes the context's EngineState explicitly."""
