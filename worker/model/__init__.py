"""The forward pass: Llama-family weights, paged attention, the model runner, the sampler, model folders on disk."""
