"""The engine: requests in, tokens out. `Engine` (engine.py) drives prefill, plain decode
steps and speculative rounds over the `Scheduler`'s batch, with the settings of an `EngineConfig`
(config.py); requests.py normalises what a caller asks;
stats.py counts; threads.py chooses the CPU thread count."""
