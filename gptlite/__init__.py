"""GPT-lite: the model, its character data and corpus, and the suite's error type (the bottom layer)."""
