"""Models built from pimlayers: the Llama 3 family (`llama3`) and Hugging Face checkpoint I/O (`hf`)."""
