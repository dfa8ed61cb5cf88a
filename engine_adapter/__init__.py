"""The bundled Llama-style engine (torch) and its store connector."""
