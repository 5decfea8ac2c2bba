"""The training core: run configuration, records, memory measurement, distributed setup.

Below the backends and the loop; imports only gptlite (and torch)."""
