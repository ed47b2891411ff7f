"""The files a run reads from outside itself and the one file format zoff writes by hand, below the models,
the engine and the checkpoints that use them: the safetensors format (tensorfile) and Hugging Face Hub ids
resolved to local folders (hub)."""
