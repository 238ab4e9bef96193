"""Reading checkpoints: fetching, weights, tokenizer."""
