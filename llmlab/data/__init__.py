"""Text in, token blocks out: corpora, cleaning, the GPT-2 tokenizer, packing and caching, instruction data."""
