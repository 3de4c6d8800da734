"""Text to token ids and back, exactly as the workers do it: tokenizer, chat template, prefix-token cache, detokenizer."""
