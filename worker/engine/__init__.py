"""The engine: sequences, block pool, scheduler and the step loop, free of torch (the model runner is loaded lazily)."""
