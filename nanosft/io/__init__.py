"""Files below the core: Hugging Face folders (config.json, safetensors, sharded or not, written
atomically) and the local Hub cache. Imports nothing of nanosft."""
